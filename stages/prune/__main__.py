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
from pipelines.config import ConfigError, load_params, require, run_stage
from pipelines.ir import (count_ops, dtype_of, graph_cost, load_ir, nbytes, op_cost, save_ir,
                         shape_of)
from stages.optimize.passes import update_outputs
from stages.optimize.schedule import classify, saved_for_backward
from stages.prune.prune import sparse_step
from stages.prune.scheme import select

OUT = ARTIFACTS / "prune"
AUTODIFF = ARTIFACTS / "autodiff"
LAYERS = ARTIFACTS / "import" / "layers.json"


def step_cost(step, signature: dict) -> dict:
    """What one training step computes and keeps: graph cost (ops, FLOPs, bytes produced),
    FLOPs of the backward pass and updates, the bytes of parameter gradients and optimizer
    state (read off the step's own input types), and the activations saved for backward."""
    inputs = dict(zip(signature["inputs"], step.params))
    channels = signature.get("channels", {})

    def gradient(param) -> tuple[int, int]:  # (elements, bytes) of the gradient computed
        shape = shape_of(inputs[param])
        if param in channels:
            shape[channels[param]["axis"]] = len(channels[param]["index"])
        itemsize = tvm.runtime.DataType(dtype_of(inputs[param])).bits // 8
        return math.prod(shape), math.prod(shape) * itemsize

    updates = update_outputs(signature)
    kinds = classify(step, updates)
    backward = sum(op_cost(b.value)[0] for b in step.body.blocks[0].bindings
                   if kinds[b.var] != "forward" and isinstance(b.value, relax.Call)
                   and isinstance(b.value.op, tvm.ir.Op))
    return {
        **graph_cost(step),
        "backward_flops": backward,
        "trainable_elements": sum(gradient(p)[0] for p in signature["trainable"]),
        "param_grad_bytes": sum(gradient(p)[1] for p in signature["trainable"]),
        "optimizer_state_bytes": sum(nbytes(inputs[n]) for n in signature["optimizer_state"]),
        "saved_activation_bytes": saved_for_backward(step, updates),
    }


def report(full, full_signature: dict, pruned, signature: dict, gradient_slicing: dict) -> dict:
    before, after = step_cost(full, full_signature), step_cost(pruned, signature)
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


def all_trainable(signature: dict) -> dict:
    """The full step's signature with every parameter trainable (full backpropagation)."""
    params = signature["inputs"][2:2 + signature["num_params"]]
    return dict(signature, trainable=params, channels={})


def prune_scheme(scheme: dict, layers: dict, full, signature: dict) -> tuple:
    """(pruned step, its signature, report) of ``scheme`` applied to the full step."""
    selection = select(scheme, layers)
    pruned, new_signature, slicing = sparse_step(full, signature, selection)
    new_signature["scheme"] = scheme["name"]
    summary = report(full, all_trainable(signature), pruned, new_signature, slicing)
    return pruned, new_signature, summary


def main() -> None:
    params = load_params()
    scheme = require(params, "sparse")
    if scheme.get("lora"):
        raise ConfigError(f"params.yaml: sparse={scheme['name']!r} is a LoRA scheme (sparse.lora): "
                          "its adapters are added by the stages that build text models, "
                          "text_task and workloads (text_task.schemes, workloads.models); this "
                          "pipeline's import stage builds the model without adapters")
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
