"""optimize: graph optimizations of the pruned step, and its planned peak memory.

Outputs (artifacts/optimize/): train_step.relax.py / .json (reordered when
``optimize.reorder_updates``, then fused) and plan.json (planned peak and its breakdown).
"""
from __future__ import annotations

import json

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import ConfigError, load_params, require, run_stage
from pipelines.ir import load_ir, save_ir
from stages.optimize.passes import memory_plan, optimize

OUT = ARTIFACTS / "optimize"
PRUNED = ARTIFACTS / "prune" / "train_step.json"
SIGNATURE = ARTIFACTS / "prune" / "signature.json"


def main() -> None:
    cfg = require(load_params(), "optimize")
    reorder = cfg.get("reorder_updates")
    if not isinstance(reorder, bool):
        raise ConfigError(f"params.yaml: optimize.reorder_updates={reorder!r}; allowed: "
                          "true, false")
    signature = json.loads(SIGNATURE.read_text())
    mod = optimize(load_ir(PRUNED)["train_step"], signature, reorder)
    plan = memory_plan(mod, signature) | {"reorder_updates": reorder}
    with atomic_dir(OUT) as tmp:
        save_ir(mod, tmp, "train_step")
        write_json_atomic(tmp / "plan.json", plan)
        write_manifest(tmp, "optimize", {"pruned": PRUNED, "signature": SIGNATURE},
                       {"optimize": cfg})
    print(f"optimize: {len(mod.functions) - 1} fused kernels; planned peak "
          f"{plan['planned_peak_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    run_stage(main)
