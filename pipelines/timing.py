"""The one wall-clock loop every timing of pockengine uses: benchmark cases, the profile, the
backend measurement."""
from __future__ import annotations

import time


def step_times(step, warmup: int, steps: int, min_seconds: float = 0.0) -> list[float]:
    """Milliseconds of each timed call of ``step()``, after ``warmup`` untimed ones: at least
    ``steps`` calls, and more until they took ``min_seconds`` in all (a 1 ms step timed 15
    times is 15 ms of a noisy machine, which one interruption can double)."""
    for _ in range(warmup):
        step()
    times, total = [], 0.0
    while len(times) < steps or total < min_seconds * 1e3:
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        total += times[-1]
    return times
