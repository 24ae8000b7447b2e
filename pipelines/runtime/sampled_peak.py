"""The peak resident memory of this process, and the peers' timed loop (``timed_steps``), for
the scripts that run a step off this process (on_device.py, the *_in_container.py peers), which
carry this file beside them: standard library only.

The kernel's high-water mark (VmHWM, getrusage's ru_maxrss) is brought up to date when memory
is unmapped, not when the kernel reclaims pages. Near a container's memory limit it reclaims the
process's file pages (its libraries) while its heap grows, so the mark can fall short of the
peak. A thread reads the resident size every few milliseconds instead; the peak is the larger
of its maximum and the mark (which catches peaks shorter than a read).
"""
import os
import resource
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class SampledPeak:
    """``with SampledPeak() as peak: ...``; then ``peak.bytes``."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.sampled = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while True:
            self.sampled = max(self.sampled, resident_bytes())
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    @property
    def bytes(self) -> int:
        return max(self.sampled, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def timed_steps(step, warmup: int, steps: int) -> dict:
    """``step()`` (one training step, returning its loss) run ``warmup + steps`` times: every
    step's loss, and the times in ms of those after the warm-up."""
    losses, times = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        losses.append(float(step()))
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"losses": losses, "times_ms": times}
