"""Run a built training step on the device itself: one step on given inputs, then timed steps.

Usage: python on_device.py LIBRARY INPUTS.npz OUTPUT.npz WARMUP STEPS
INPUTS.npz holds the step's arguments in call order (arg_000, arg_001, ...); OUTPUT.npz gets
the first step's outputs (out_000 = loss, then the new state), ``times_ms``, one per timed
step, and ``peak_rss_bytes``, the process's peak resident memory (sampled_peak.py, which travels
beside this file). Needs only numpy and TVM's runtime, so it runs where PyTorch does not: under
qemu in an aarch64 root (the emulated runner), in a container of the runtime image (the docker
runner), or on a board by hand.
"""
import sys
import time

import numpy as np
import tvm
from tvm import relax

from sampled_peak import SampledPeak


def _tensor(array: np.ndarray, device):
    """``array`` on ``device``. A bfloat16 array (a frozen weight stored so) comes out of the
    .npz as 2-byte voids, its bytes kept: numpy has no bfloat16 without ml_dtypes, which the
    device need not have."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return tvm.runtime.empty(array.shape, "bfloat16", device).copyfrom(array)
    return tvm.runtime.tensor(array, device)


def run(library: str, inputs: str, warmup: int, steps: int) -> tuple[list[float], dict]:
    """The timed steps' times and the first step's outputs."""
    device = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(library), device)
    with np.load(inputs) as arrays:
        args = [_tensor(arrays[name], device) for name in sorted(arrays.files)]
    outputs = vm["train_step"](*args)
    results = {f"out_{i:03d}": value.numpy() for i, value in enumerate(outputs)}
    times = []
    for i in range(warmup + steps):  # same inputs each time: only the time is kept
        start = time.perf_counter()
        vm["train_step"](*args)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, results


if __name__ == "__main__":
    with SampledPeak() as peak:
        times, results = run(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]))
    np.savez(sys.argv[3], times_ms=np.array(times), peak_rss_bytes=np.array(peak.bytes),
             **results)
