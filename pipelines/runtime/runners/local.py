"""This machine: another build for its CPU (e.g. another -mcpu), checked and timed here, in this
process."""
from __future__ import annotations

from pathlib import Path

SECTION = None
TAKES_ARCHIVE = False
RUNS_HERE = True
LABEL = "compiled"


def run(library: Path, args: list, profile, warmup: int, steps: int):
    import tvm
    from tvm import relax

    from pipelines.timing import step_times

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    inputs = [tvm.runtime.tensor(a) for a in args]
    outputs = [o.numpy() for o in vm["train_step"](*inputs)]
    return outputs, step_times(lambda: vm["train_step"](*inputs), warmup, steps), {}
