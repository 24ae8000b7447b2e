"""Which CPU target makes the fastest code for this machine: the optimized step compiled for
several `-mcpu` values and timed here side by side, rounds interleaved so drift hits all alike.

Usage: python -m stages.benchmark.targets [MCPU ...]   (default: x86-64-v2 x86-64-v3 x86-64-v4)
Needs `dvc repro optimize` (and data, lower) first. Prints the median step time of each round.
This is how the host profile's mcpu was chosen (device_profiles/host.yaml).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from pipelines.artifacts import ARTIFACTS
from pipelines.config import load_params, load_profile
from pipelines.ir import load_ir
from pipelines.step import CompiledStep, load_initial
from pipelines.timing import step_times
from stages.benchmark.cases import first_batch
from stages.build.toolchain import compile_step


def main(mcpus: list[str], rounds: int = 5, steps: int = 20) -> None:
    mod = load_ir(ARTIFACTS / "optimize" / "train_step.json")
    initial = load_initial(ARTIFACTS / "lower" / "params.npz")
    x, y = first_batch(str(ARTIFACTS / "data" / "digits.npz"),
                       int(load_params()["model"]["batch_size"]))
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for mcpu in mcpus:  # the host profile with only -mcpu changed, built as build@host does
            directory = Path(tmp) / mcpu
            directory.mkdir()
            compile_step(mod, load_profile("host", {"host": {"target": {"mcpu": mcpu}}}),
                         directory)
            shutil.copy(ARTIFACTS / "prune" / "signature.json", directory / "signature.json")
            built[mcpu] = CompiledStep(directory, initial)
        medians = {mcpu: [] for mcpu in mcpus}
        for _ in range(rounds):
            for mcpu, step in built.items():
                args = step.arguments(x, y)
                medians[mcpu].append(float(np.median(
                    step_times(lambda: step.function(*args), 3, steps))))
    for mcpu, values in medians.items():
        print(f"{mcpu:>12}: median of rounds {np.median(values):.2f} ms/step "
              f"(rounds: {' '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["x86-64-v2", "x86-64-v3", "x86-64-v4"])
