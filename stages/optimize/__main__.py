"""optimize: graph optimizations of the pruned step, and its planned peak memory.

Outputs (artifacts/optimize/): train_step.relax.py / .json (reordered when
``optimize.reorder_updates``, then fused) and plan.json (planned peak and its breakdown).
``optimize.recompute`` decides whether cheap activations are recomputed in the backward pass
instead of kept (stages/optimize/recompute.py): never; always; or auto, which also writes the
recomputing twin (train_step_recompute.*, its plan under plan.json's ``recompute``) for a
device build to take when the plain step is over that device's memory budget.
"""
from __future__ import annotations

import json

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import ConfigError, choose, load_params, require, run_stage
from pipelines.ir import load_ir, save_ir
from stages.optimize.passes import memory_plan, optimize

OUT = ARTIFACTS / "optimize"
PRUNED = ARTIFACTS / "prune" / "train_step.json"
SIGNATURE = ARTIFACTS / "prune" / "signature.json"
RECOMPUTE = ("never", "auto", "always")


def main() -> None:
    cfg = require(load_params(), "optimize")
    reorder = cfg.get("reorder_updates")
    if not isinstance(reorder, bool):
        raise ConfigError(f"params.yaml: optimize.reorder_updates={reorder!r}; allowed: "
                          "true, false")
    policy = choose(cfg.get("recompute"), RECOMPUTE, "optimize.recompute")
    signature = json.loads(SIGNATURE.read_text())
    pruned = load_ir(PRUNED)["train_step"]
    mod = optimize(pruned, signature, reorder, recomputed=policy == "always")
    plan = memory_plan(mod, signature) | {"reorder_updates": reorder,
                                          "recomputed": policy == "always", "recompute": None}
    twin = None
    if policy == "auto":
        twin = optimize(pruned, signature, reorder, recomputed=True)
        plan["recompute"] = memory_plan(twin, signature) | {"recomputed": True}
    with atomic_dir(OUT) as tmp:
        save_ir(mod, tmp, "train_step")
        if twin is not None:
            save_ir(twin, tmp, "train_step_recompute")
        write_json_atomic(tmp / "plan.json", plan)
        write_manifest(tmp, "optimize", {"pruned": PRUNED, "signature": SIGNATURE},
                       {"optimize": cfg})
    print(f"optimize: {len(mod.functions) - 1} fused kernels; planned peak "
          f"{plan['planned_peak_bytes'] / 2**20:.2f} MiB"
          + (f" ({plan['recompute']['planned_peak_bytes'] / 2**20:.2f} MiB recomputing cheap "
             "activations)" if twin is not None else ""))


if __name__ == "__main__":
    run_stage(main)
