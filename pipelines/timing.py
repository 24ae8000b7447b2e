"""The one wall-clock loop every timing of pockengine uses: benchmark cases, the profile, the
backend measurement."""
from __future__ import annotations

import time


def step_times(step, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``step()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times
