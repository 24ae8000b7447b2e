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
import time
from pathlib import Path

import numpy as np
import tvm

from pipelines.artifacts import ARTIFACTS
from pipelines.config import load_params
from pipelines.ir import load_ir
from pipelines.step import CompiledStep, load_initial
from stages.benchmark.cases import first_batch


def main(mcpus: list[str], rounds: int = 5, steps: int = 20) -> None:
    mod = load_ir(ARTIFACTS / "optimize" / "train_step.json")
    initial = load_initial(ARTIFACTS / "lower" / "params.npz")
    batch = int(load_params()["model"]["batch_size"])
    x, y = first_batch(str(ARTIFACTS / "data" / "digits.npz"), batch)
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for mcpu in mcpus:
            directory = Path(tmp) / mcpu
            directory.mkdir()
            target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                        "mcpu": mcpu})
            tvm.compile(mod, target=target).export_library(str(directory / "step.so"))
            shutil.copy(ARTIFACTS / "prune" / "signature.json", directory / "signature.json")
            built[mcpu] = CompiledStep(directory, initial)
        medians = {mcpu: [] for mcpu in mcpus}
        for _ in range(rounds):
            for mcpu, step in built.items():
                args = step.arguments(x, y)
                for _ in range(3):
                    step.function(*args)
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step.function(*args)
                    times.append(time.perf_counter() - start)
                medians[mcpu].append(float(np.median(times)) * 1e3)
    for mcpu, values in medians.items():
        print(f"{mcpu:>12}: median of rounds {np.median(values):.2f} ms/step "
              f"(rounds: {' '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main(sys.argv[1:] or ["x86-64-v2", "x86-64-v3", "x86-64-v4"])
