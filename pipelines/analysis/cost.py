"""What a training step computes and keeps: operator counts, FLOPs, bytes produced, the backward
pass's FLOPs, gradient and optimizer-state bytes, saved activations; and what a scheme removes
from full backpropagation (the prune stage's report.json)."""
from __future__ import annotations

import math

import tvm
from tvm import relax

from pipelines.analysis.liveness import classify, saved_for_backward, update_owners
from pipelines.ir import dtype_of, nbytes, shape_of, signature_of


def _tensor_types(ty) -> list[relax.TensorType]:
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return [ty]
    if isinstance(ty, relax.TupleType):
        return [t for field in ty.fields for t in _tensor_types(field)]
    return []


def count_ops(func) -> dict[str, int]:
    """Operator name -> number of calls in a Relax function (TIR calls by callee name)."""
    counts: dict[str, int] = {}

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            name = op.name if isinstance(op, tvm.ir.Op) else getattr(op, "name_hint", str(op))
            if name in ("relax.call_tir", "relax.call_tir_inplace"):
                name = expr.args[0].name_hint
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    return dict(sorted(counts.items()))


def op_cost(call) -> tuple[int, int]:
    """(FLOPs, bytes written) of one high-level Relax call, before legalization.

    Convolutions and matmuls count 2 FLOPs per multiply-accumulate; other ops one per output
    element. Bytes are the sizes of the values the call produces."""
    outs = _tensor_types(call.ty)
    written = sum(nbytes(t) for t in outs)
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
    if name in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
        data, w = shape_of(call.args[0]), shape_of(call.args[1])
        if name == "relax.nn.conv2d":
            cin = data[str(call.attrs.data_layout).index("C")]
            macs = math.prod(shape_of(outs[0])) * (cin // int(call.attrs.groups)) * w[2] * w[3]
        else:  # transpose: every input element meets a (cout/groups x kh x kw) slice
            macs = math.prod(data) * w[1] * w[2] * w[3]
        return 2 * macs, written
    if name == "relax.matmul":
        return 2 * math.prod(shape_of(outs[0])) * shape_of(call.args[0])[-1], written
    return sum(math.prod(shape_of(t)) for t in outs), written


def graph_cost(func) -> dict:
    """Op count, FLOPs and bytes produced by every call bound in ``func``."""
    ops = flops = written = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                f, b = op_cost(value)
                ops, flops, written = ops + 1, flops + f, written + b
    return {"ops": ops, "flops": flops, "bytes_produced": written}


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

    updates = update_owners(signature)
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


def scheme_report(full: tvm.IRModule, pruned: tvm.IRModule) -> dict:
    """What the scheme the ``pruned`` step carries removes from the ``full`` step (both modules
    with their signatures): ops, FLOPs, backward FLOPs, gradient, state and saved-activation
    bytes; the channel-sparse parameters and how their gradient slice is computed."""
    full_signature, signature = signature_of(full), signature_of(pruned)
    before = step_cost(full["train_step"], all_trainable(full_signature))
    after = step_cost(pruned["train_step"], signature)
    return {
        "scheme": signature["scheme"],
        "trainable_parameters": len(signature["trainable"]),
        "trainable_elements": after["trainable_elements"],
        "total_elements": before["trainable_elements"],
        "channel_sparse": {signature["source_names"][p]: {
            "axis": c["axis"], "channels": len(c["index"]), "gradient": c["gradient"]}
            for p, c in signature["channels"].items()},
        "full": before,
        "pruned": after,
        "removed": {k: before[k] - after[k] for k in before},
        "removed_fraction": {k: round((before[k] - after[k]) / before[k], 4) if before[k] else 0
                             for k in before},
        "ops_full": count_ops(full["train_step"]),
        "ops_pruned": count_ops(pruned["train_step"]),
    }


def all_trainable(signature: dict) -> dict:
    """The full step's signature with every parameter trainable (full backpropagation)."""
    data = len(signature["data"])
    params = signature["inputs"][data:data + signature["num_params"]]
    return dict(signature, trainable=params, channels={})
