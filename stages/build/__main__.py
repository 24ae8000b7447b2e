"""build@device: compile the optimized step for one device profile.

Usage: python -m stages.build <device>
Outputs (artifacts/build/<device>/): step.so (load with tvm.runtime.load_module), signature.json
(how to call it), manifest.json (input hashes, target, TVM version, toolchain).
A step whose planned peak memory exceeds the profile's budget is refused before compiling.
"""
from __future__ import annotations

import json
import shutil
import sys

import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_manifest
from pipelines.config import check_memory_budget, load_profile, run_stage, tvm_target
from pipelines.ir import load_ir

OPTIMIZED = ARTIFACTS / "optimize" / "train_step.json"
SIGNATURE = ARTIFACTS / "prune" / "signature.json"
PLAN = ARTIFACTS / "optimize" / "plan.json"
LIBRARY = "step.so"


def build(device: str) -> None:
    profile = load_profile(device)
    check_memory_budget(json.loads(PLAN.read_text()), profile)
    target = tvm_target(profile)
    mod = load_ir(OPTIMIZED)
    executable = tvm.compile(mod, target=target)
    with atomic_dir(ARTIFACTS / "build" / device) as tmp:
        executable.export_library(str(tmp / LIBRARY))
        shutil.copyfile(SIGNATURE, tmp / "signature.json")
        write_manifest(tmp, f"build@{device}", {"optimized": OPTIMIZED, "signature": SIGNATURE,
                                                "plan": PLAN},
                       {"profile": profile, "target": str(target)})
    print(f"built {device}: {target}")


if __name__ == "__main__":
    run_stage(lambda: build(sys.argv[1]))
