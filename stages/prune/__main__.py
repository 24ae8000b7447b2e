"""sparse_prune: apply the sparse-update scheme to the full training step.

Outputs (artifacts/prune/):
  train_step.relax.py / .json  the pruned step: only the scheme's parameters are updated
  signature.json               inputs/outputs in order, trainable parameters
  report.json                  ops, FLOPs and bytes of the full and the pruned step
"""
from __future__ import annotations

import json
import math

import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.ir import count_ops, graph_cost, load_ir, save_ir
from stages.prune.prune import prune_step
from stages.prune.scheme import select

OUT = ARTIFACTS / "prune"
AUTODIFF = ARTIFACTS / "autodiff"
LAYERS = ARTIFACTS / "import" / "layers.json"


def report(full, pruned, signature: dict, layers: dict) -> dict:
    before, after = graph_cost(full), graph_cost(pruned)
    sizes = {p["name"]: p["shape"] for p in layers["parameters"]}
    torch_names = signature["torch_names"]
    trainable_elems = sum(math.prod(sizes[torch_names[p]])
                          for p in signature["trainable"])
    total_elems = sum(math.prod(s) for s in sizes.values())
    return {
        "scheme": signature["scheme"],
        "trainable_parameters": len(signature["trainable"]),
        "trainable_elements": trainable_elems,
        "total_elements": total_elems,
        "full": before,
        "pruned": after,
        "removed": {k: before[k] - after[k] for k in before},
        "removed_fraction": {k: round((before[k] - after[k]) / before[k], 4) for k in before},
        "ops_full": count_ops(full),
        "ops_pruned": count_ops(pruned),
    }


def main() -> None:
    params = load_params()
    scheme = require(params, "sparse")
    layers = json.loads(LAYERS.read_text())
    signature = json.loads((AUTODIFF / "signature.json").read_text())
    selected = select(scheme, layers)
    relax_of = {torch: relax for relax, torch in signature["torch_names"].items()}
    full = load_ir(AUTODIFF / "train_step.json")["train_step"]
    pruned, new_signature = prune_step(full, signature, {relax_of[n] for n in selected})
    new_signature["scheme"] = scheme["name"]
    summary = report(full, pruned, new_signature, layers)
    with atomic_dir(OUT) as tmp:
        save_ir(tvm.IRModule({"train_step": pruned}), tmp, "train_step")
        write_json_atomic(tmp / "signature.json", new_signature)
        write_json_atomic(tmp / "report.json", summary)
        write_manifest(tmp, "sparse_prune", {"autodiff": AUTODIFF / "train_step.json",
                                             "layers": LAYERS}, {"sparse": scheme})
    print(f"scheme {scheme['name']}: {len(selected)} parameters trainable; removed "
          f"{summary['removed']['ops']} of {summary['full']['ops']} ops, "
          f"{summary['removed_fraction']['flops']:.1%} of FLOPs")


if __name__ == "__main__":
    run_stage(main)
