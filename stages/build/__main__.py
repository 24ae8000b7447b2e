"""build@device: compile the optimized step for one device profile.

Usage: python -m stages.build <device>
Outputs (artifacts/build/<device>/): step.so (load with tvm.runtime.load_module), signature.json
(how to call it), plan.json (the planned memory of the step built), manifest.json (input hashes,
target, TVM version, toolchain, whether activations are recomputed).
A step whose planned peak memory exceeds the profile's budget takes the optimize stage's
recomputing twin when there is one that fits (optimize.recompute=auto), else is refused before
compiling.
"""
from __future__ import annotations

import json
import shutil
import sys

import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import check_memory_budget, load_profile, run_stage, tvm_target
from pipelines.ir import load_ir

OPTIMIZE = ARTIFACTS / "optimize"
SIGNATURE = ARTIFACTS / "prune" / "signature.json"
LIBRARY = "step.so"


def build(device: str) -> None:
    profile = load_profile(device)
    plan = json.loads((OPTIMIZE / "plan.json").read_text())
    recompute = check_memory_budget(plan, profile)
    optimized = OPTIMIZE / ("train_step_recompute.json" if recompute else "train_step.json")
    target = tvm_target(profile)
    executable = tvm.compile(load_ir(optimized), target=target)
    with atomic_dir(ARTIFACTS / "build" / device) as tmp:
        executable.export_library(str(tmp / LIBRARY))
        shutil.copyfile(SIGNATURE, tmp / "signature.json")
        write_json_atomic(tmp / "plan.json", plan["recompute"] if recompute else plan)
        write_manifest(tmp, f"build@{device}", {"optimized": optimized, "signature": SIGNATURE},
                       {"profile": profile, "target": str(target),
                        "recomputed": recompute or plan["recomputed"]})
    print(f"built {device}: {target}" + (" (recomputing cheap activations to fit "
                                         "its memory budget)" if recompute else ""))


if __name__ == "__main__":
    run_stage(lambda: build(sys.argv[1]))
