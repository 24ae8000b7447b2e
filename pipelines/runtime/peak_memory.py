"""Peak resident memory of a piece of work, above the process's resident memory before it.

Linux resets the high-water mark (VmHWM) when "5" is written to /proc/self/clear_refs, so the
peak of the measured work is not hidden by the peak of imports and setup.
"""
from __future__ import annotations

from pathlib import Path

from pipelines.runtime.sampled_peak import resident_bytes


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def release_freed() -> None:
    """Give the pages of freed heap memory back to the system (glibc's malloc_trim). glibc
    keeps them resident, so a setup's freed temporaries (the numpy copies a state is made from)
    would count in the process's footprint, or be reused by what the measured work allocates
    and hide it. Elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def peak_resident_bytes() -> int:
    """The process's peak resident memory so far (VmHWM: unlike getrusage's ru_maxrss, not
    the peak of the process it was forked from)."""
    return _status_kib("VmHWM") * 1024


class PeakRSS:
    """The peak from here on above ``since`` (resident bytes, resident_bytes(); default: the
    resident memory on entering): what was set up between ``since`` and entering counts as it
    stands, not the transient copies setting it up made."""

    def __init__(self, since: int | None = None):
        self.since = since

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")
        self.baseline_kib = (resident_bytes() if self.since is None else self.since) // 1024
        return self

    def __exit__(self, *exc):
        self.peak_kib = _status_kib("VmHWM")
        return False

    @property
    def above_baseline_bytes(self) -> int:
        return max(0, self.peak_kib - self.baseline_kib) * 1024

    def so_far_bytes(self) -> int:
        """The peak above the baseline up to now, inside the measured work."""
        return max(0, _status_kib("VmHWM") - self.baseline_kib) * 1024


class HeldOnGPU:
    """GPU memory a process holds above what it held when this started (its CUDA context
    made), read from the driver's free-memory count: the same yardstick for a compiled step
    (TVM's pooled allocator keeps what it allocated) and PyTorch (its caching allocator keeps
    its blocks, and cuBLAS its workspace). Other processes must not allocate between the two
    readings: evaluate/speed.py reads it while each case warms up alone."""

    def __enter__(self):
        import torch

        torch.zeros(1, device="cuda")  # the context, outside the measurement
        torch.cuda.synchronize()
        self.free_before = torch.cuda.mem_get_info()[0]
        self.held_bytes = 0
        return self

    def read(self) -> int:
        import torch

        torch.cuda.synchronize()
        self.held_bytes = max(self.held_bytes, self.free_before - torch.cuda.mem_get_info()[0])
        return self.held_bytes

    def __exit__(self, *exc):
        return False
