"""The one wall-clock loop every timing of pockengine uses: benchmark cases, the profile, the
backend measurement; and how long this process has run (a stage's compile time)."""
from __future__ import annotations

import os
import time
from pathlib import Path

_STARTED = time.monotonic()  # the fallback where /proc is absent: when this module loaded


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


def process_seconds() -> float:
    """Wall seconds since this process started: its interpreter's start and imports included,
    as a user waiting for a stage sees it (Linux's /proc; elsewhere, since this module loaded)."""
    try:
        # /proc/self/stat's 22nd field, counted after the command's closing parenthesis
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return time.monotonic() - _STARTED
    return uptime - started / os.sysconf("SC_CLK_TCK")
