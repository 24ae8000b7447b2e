"""build@device: compile the optimized step for one device profile.

Usage: python -m stages.build <device>
Outputs (artifacts/build/<device>/): step.so (load with tvm.runtime.load_module) or, for a
profile whose toolchain.output is archive, step.tar (object files the device links);
signature.json (how to call it), plan.json (the planned memory of the step built),
manifest.json (input hashes, target, TVM version, toolchain and linking, whether activations
are recomputed).
CPU kernels take the tune stage's schedules (artifacts/tune/<device>/) where it has one, the
default schedules otherwise.
A step whose planned peak memory exceeds the profile's budget takes the optimize stage's
recomputing twin when there is one that fits (optimize.recompute=auto), else is refused before
compiling. A missing cross compiler or nvcc is refused before compiling too, naming the
package to install.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import ConfigError, check_memory_budget, resolved_profile, run_stage
from pipelines.ir import load_ir
from pipelines.tuning import open_database
from stages.build.toolchain import compile_step

OPTIMIZE = ARTIFACTS / "optimize"
SIGNATURE = ARTIFACTS / "prune" / "signature.json"
TUNE = ARTIFACTS / "tune"  # the tune stage's database per device


def step_to_build(profile: dict) -> tuple[dict, bool, Path]:
    """The optimize stage's plan, whether the device takes the recomputing twin (its budget
    fits only that one), and the step's file."""
    plan = json.loads((OPTIMIZE / "plan.json").read_text())
    recompute = check_memory_budget(plan, profile)
    return plan, recompute, OPTIMIZE / ("train_step_recompute.json" if recompute
                                        else "train_step.json")


def build(device: str) -> None:
    profile = resolved_profile(device)
    plan, recompute, optimized = step_to_build(profile)
    if not (TUNE / device).is_dir():
        raise ConfigError(f"{TUNE / device}: not found; run `dvc repro tune@{device}` first")
    with atomic_dir(ARTIFACTS / "build" / device) as tmp:
        built = compile_step(load_ir(optimized), profile, tmp, open_database(TUNE / device))
        shutil.copyfile(SIGNATURE, tmp / "signature.json")
        write_json_atomic(tmp / "plan.json", plan["recompute"] if recompute else plan)
        write_manifest(tmp, f"build@{device}", {"optimized": optimized, "signature": SIGNATURE,
                                                 "tuning": TUNE / device},
                       {"profile": profile, **built,
                        "recomputed": recompute or plan["recomputed"]})
    print(f"built {device}: {built['library']} ({built['library_bytes'] / 2**20:.2f} MiB, "
          f"{built['output']}{', linked on the device' if built['links_on_device'] else ''})"
          + (" recomputing cheap activations to fit its memory budget" if recompute else ""))


if __name__ == "__main__":
    run_stage(lambda: build(sys.argv[1]))
