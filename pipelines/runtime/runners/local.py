"""This machine: another build for its CPU (e.g. another -mcpu), or for its NVIDIA GPU (a CUDA
target, the kernels on the GPU), checked and timed here, in this process. A CUDA build on a
machine without a GPU is not reachable: docs/gpu.md runs it where one is."""
from __future__ import annotations

from pathlib import Path

SECTION = None
TAKES_ARCHIVE = False
RUNS_HERE = True
LABEL = "compiled"


def _device(profile):
    import tvm

    if profile.target["kind"] != "cuda":
        return tvm.cpu()
    from pipelines.runtime.cuda import cuda_device
    from pipelines.runtime.runners import NotReachable

    try:
        return cuda_device()
    except (RuntimeError, OSError) as err:
        raise NotReachable(f"{profile.source}: {err}; docs/gpu.md runs a CUDA build on a "
                           "machine with the GPU") from None


def run(library: Path, args: list, profile, warmup: int, steps: int):
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from pipelines.timing import step_times

    device = _device(profile)
    vm = VirtualMachine(tvm.runtime.load_module(str(library)), device)
    inputs = [tvm.runtime.tensor(a, device) for a in args]
    outputs = [o.numpy() for o in vm["train_step"](*inputs)]

    def step():  # a GPU's kernels run asynchronously: a step ends when they are done
        vm["train_step"](*inputs)
        device.sync()

    return outputs, step_times(step, warmup, steps), {}
