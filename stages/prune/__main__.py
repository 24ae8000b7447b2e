"""sparse_prune: apply the sparse-update scheme to the full training step.

Outputs (artifacts/prune/):
  train_step.relax.py / .json  the pruned step: only the scheme's parameters (and channels)
                               are updated
  signature.json               inputs/outputs in order, trainable parameters, channels
  report.json                  what the scheme removes from full backpropagation: ops, FLOPs,
                               parameter-gradient and optimizer-state bytes, saved activations
"""
from __future__ import annotations

import json
import math

import tvm
from tvm import relax

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.ir import count_ops, graph_cost, load_ir, op_cost, save_ir
from stages.optimize.passes import update_outputs
from stages.optimize.schedule import classify, saved_for_backward
from stages.prune.prune import sparse_step
from stages.prune.scheme import select

OUT = ARTIFACTS / "prune"
AUTODIFF = ARTIFACTS / "autodiff"
LAYERS = ARTIFACTS / "import" / "layers.json"
FLOAT_BYTES = 4


def step_cost(step, signature: dict, layers: dict) -> dict:
    """What one training step computes and keeps: graph cost (ops, FLOPs, bytes produced),
    FLOPs of the backward pass and updates, the bytes of parameter gradients and optimizer
    state, and the activations saved for backward."""
    shapes = {p["name"]: p["shape"] for p in layers["parameters"]}
    torch_names, channels = signature["torch_names"], signature.get("channels", {})

    def elements(param):
        shape = list(shapes[torch_names[param]])
        if param in channels:
            shape[channels[param]["axis"]] = len(channels[param]["index"])
        return math.prod(shape)

    state_elems = sum(math.prod(info["shape"]) if "shape" in info
                      else elements(info["param"]) if info["param"] else 1
                      for info in signature["optimizer_state"].values())
    kinds = classify(step, update_outputs(signature))
    backward = sum(op_cost(b.value)[0] for b in step.body.blocks[0].bindings
                   if kinds[b.var] != "forward" and isinstance(b.value, relax.Call)
                   and isinstance(b.value.op, tvm.ir.Op))
    return {
        **graph_cost(step),
        "backward_flops": backward,
        "trainable_elements": sum(elements(p) for p in signature["trainable"]),
        "param_grad_bytes": FLOAT_BYTES * sum(elements(p) for p in signature["trainable"]),
        "optimizer_state_bytes": FLOAT_BYTES * state_elems,
        "saved_activation_bytes": saved_for_backward(step, update_outputs(signature)),
    }


def report(full, full_signature: dict, pruned, signature: dict, layers: dict,
           gradient_slicing: dict) -> dict:
    before, after = step_cost(full, full_signature, layers), step_cost(pruned, signature, layers)
    return {
        "scheme": signature["scheme"],
        "trainable_parameters": len(signature["trainable"]),
        "trainable_elements": after["trainable_elements"],
        "total_elements": before["trainable_elements"],
        "channel_sparse": {signature["torch_names"][p]: {
            "axis": c["axis"], "channels": len(c["index"]), "gradient": gradient_slicing[p]}
            for p, c in signature["channels"].items()},
        "full": before,
        "pruned": after,
        "removed": {k: before[k] - after[k] for k in before},
        "removed_fraction": {k: round((before[k] - after[k]) / before[k], 4) if before[k] else 0
                             for k in before},
        "ops_full": count_ops(full),
        "ops_pruned": count_ops(pruned),
    }


def prune_scheme(scheme: dict, layers: dict, full, signature: dict) -> tuple:
    """(pruned step, its signature, report) of ``scheme`` applied to the full step."""
    selection = select(scheme, layers)
    pruned, new_signature, slicing = sparse_step(full, signature, selection)
    new_signature["scheme"] = scheme["name"]
    params = signature["inputs"][2:2 + signature["num_params"]]
    summary = report(full, dict(signature, trainable=params, channels={}), pruned,
                     new_signature, layers, slicing)
    return pruned, new_signature, summary


def main() -> None:
    params = load_params()
    scheme = require(params, "sparse")
    layers = json.loads(LAYERS.read_text())
    signature = json.loads((AUTODIFF / "signature.json").read_text())
    full = load_ir(AUTODIFF / "train_step.json")["train_step"]
    pruned, new_signature, summary = prune_scheme(scheme, layers, full, signature)
    with atomic_dir(OUT) as tmp:
        save_ir(tvm.IRModule({"train_step": pruned}), tmp, "train_step")
        write_json_atomic(tmp / "signature.json", new_signature)
        write_json_atomic(tmp / "report.json", summary)
        write_manifest(tmp, "sparse_prune", {"autodiff": AUTODIFF / "train_step.json",
                                             "layers": LAYERS}, {"sparse": scheme})
    print(f"scheme {scheme['name']}: {summary['trainable_parameters']} parameters trainable "
          f"({len(summary['channel_sparse'])} on some channels); removed "
          f"{summary['removed']['ops']} of {summary['full']['ops']} ops, "
          f"{summary['removed_fraction']['flops']:.1%} of FLOPs, "
          f"{summary['removed_fraction']['saved_activation_bytes']:.1%} of saved activations")


if __name__ == "__main__":
    run_stage(main)
