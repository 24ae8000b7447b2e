"""optimize: graph optimizations of the pruned step, and its planned peak memory.

Outputs (artifacts/optimize/): train_step.relax.py / .json (fused), plan.json.
"""
from __future__ import annotations

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import run_stage
from pipelines.ir import load_ir, save_ir
from stages.optimize.passes import memory_plan, optimize

OUT = ARTIFACTS / "optimize"
PRUNED = ARTIFACTS / "prune" / "train_step.json"


def main() -> None:
    mod = optimize(load_ir(PRUNED))
    plan = memory_plan(mod)
    with atomic_dir(OUT) as tmp:
        save_ir(mod, tmp, "train_step")
        write_json_atomic(tmp / "plan.json", plan)
        write_manifest(tmp, "optimize", {"pruned": PRUNED}, {})
    print(f"optimize: {len(mod.functions) - 1} fused kernels; planned peak "
          f"{plan['planned_peak_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    run_stage(main)
