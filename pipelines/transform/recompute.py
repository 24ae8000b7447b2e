"""kept cheap activation a, read by backward -> a recomputed from its kept operands there.

Recompute cheap activations in the backward pass instead of keeping them from the forward.

A training step keeps every forward value its backward pass reads. Many of those are cheap to
make again from values that are kept anyway: in MobileNetV2 a ReLU6 output is clip(batch_norm(
conv output)), and the conv output is kept for batch norm's own gradient. ``recompute`` keeps
the anchors (conv and matmul outputs, the step's inputs) and, right before the first backward
binding that reads a cheap value, emits a copy of the chain that makes it from the anchors. The
forward original then dies at its last forward use. Fusion folds most copies into the backward
kernels that read them, so the recomputation costs little time.

Attention's probabilities are recomputed too, as fused attention kernels do: the product of two
activations (queries by keys) is made again from the operands its own gradient keeps anyway,
then its softmax, so the step keeps neither the probabilities nor their masked copy (a
(batch, heads, sequence, sequence) tensor each, per layer). Its cost is the scores' product
once more, small beside the projections' until the sequence is much longer than the width.

This is activation checkpointing at the granularity of cheap operators (Relax's Gradient pass
offers checkpointing of marked regions at autodiff time; this works on the pruned, reordered
step, where what the backward pass still reads is known). Run after reorder_updates.py.

Before::

    c = conv2d(x, w)                    # kept anyway: batch norm's gradient reads it
    b = batch_norm(c, ...); r = clip(b, 0, 6)         # forward
    ...
    dr = ...; db = where(r > 0 and r < 6, dr, 0)      # backward reads r: r lives till here

After::

    c = conv2d(x, w)
    b = batch_norm(c, ...); r = clip(b, 0, 6)         # r dies at its last forward use
    ...
    b_re = batch_norm(c, ...); r_re = clip(b_re, 0, 6)
    dr = ...; db = where(r_re > 0 and r_re < 6, dr, 0)
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import classify, update_owners
from pipelines.ir import nbytes, op_name, signature_of

# Operators worth recomputing: elementwise, injective and normalizations (a pass or two over
# their input). Convolutions and products by weights are the anchors: their outputs are kept.
CHEAP = {
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power",
    "relax.sqrt", "relax.rsqrt", "relax.exp", "relax.negative", "relax.astype", "relax.clip",
    "relax.nn.relu", "relax.nn.silu", "relax.nn.gelu", "relax.sigmoid", "relax.tanh",
    "relax.where", "relax.less", "relax.greater", "relax.logical_and",
    "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
    "relax.strided_slice", "relax.concat", "relax.broadcast_to",
    "relax.nn.batch_norm", "relax.nn.layer_norm", "relax.nn.rms_norm", "relax.mean",
    "relax.variance", "relax.nn.softmax",
}
# No work of their own: a view, or a fill that reads only its operand's shape.
FREE = {"relax.reshape", "relax.full_like", "relax.zeros_like", "relax.ones_like"}
# At most this many operators in one recomputed chain (free ones and tuple projections not
# counted): without a bound, residual additions would chain a recomputation back through every
# block. Attention's masked probabilities are the longest wanted: scores product, mask, softmax,
# masking, broadcast.
MAX_CHAIN = 5
# An operand this many times smaller than the value may be kept to recompute it.
SMALL = 8


def _rebuild(expr, mapping: dict):
    """``expr`` with the vars in ``mapping`` replaced (bindings hold calls, tuples, projections
    and leaves)."""
    if isinstance(expr, relax.Var):
        return mapping.get(expr, expr)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_rebuild(a, mapping) for a in expr.args], expr.attrs,
                          expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_rebuild(f, mapping) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_rebuild(expr.tuple_value, mapping), expr.index)
    return expr


def _vars_in(expr) -> list[relax.Var]:
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e)
                                    if isinstance(e, relax.Var) else None)
    return found


def _small_beside(operand: relax.Var, var: relax.Var) -> bool:
    return isinstance(operand.ty, relax.TensorType) and isinstance(var.ty, relax.TensorType) \
        and nbytes(operand) * SMALL <= nbytes(var)


def _from_batch(func: relax.Function, data: list[str]) -> set[relax.Var]:
    """Bindings whose value depends on the batch: activations, not functions of weights."""
    found = {p for p in func.params if p.name in data}
    for b in func.body.blocks[0].bindings:
        if any(v in found for v in _vars_in(b.value)):
            found.add(b.var)
    return found


def recomputable(func: relax.Function, update_outputs: dict[int, str],
                 data: list[str]) -> dict[relax.Var, int]:
    """Forward bindings the backward pass can make again, with the length of their chain.
    ``data``: the step's batch inputs (a product of two values made from them is attention's
    scores, recomputed; a product by a weight is an anchor)."""
    bindings = func.body.blocks[0].bindings
    kinds = classify(func, update_outputs)
    defined = {b.var for b in bindings}
    from_batch = _from_batch(func, data)
    # What the plain step keeps for its backward pass: forward values later bindings read.
    kept = {v for b in bindings if kinds[b.var] != "forward" for v in _vars_in(b.value)
            if v in defined and kinds[v] == "forward"}
    chain: dict[relax.Var, int] = {}
    for b in bindings:
        if kinds[b.var] != "forward":
            continue
        value = b.value
        if isinstance(value, relax.TupleGetItem) or op_name(value) in FREE:
            cost = 0
        elif op_name(value) in CHEAP or (op_name(value) == "relax.matmul" and all(
                a in from_batch for a in value.args)):
            cost = 1
        else:
            continue
        operands = [v for v in _vars_in(value) if v in defined]
        # Each operand must be there at backward time: kept anyway, recomputable itself, or
        # small beside the value and kept for it (attention's mask beside its scores).
        if all(v in chain or v in kept or _small_beside(v, b.var) for v in operands):
            length = cost + max((chain.get(v, 0) for v in operands), default=0)
            if length <= MAX_CHAIN:
                chain[b.var] = length
    return chain


def _recomputed(func: relax.Function, update_outputs: dict[int, str],
                data: list[str]) -> tuple[relax.Function, int]:
    """The step with its cheap saved activations recomputed where the backward pass reads them.
    Returns the function and how many forward values are no longer kept."""
    bindings = func.body.blocks[0].bindings
    kinds = classify(func, update_outputs)
    chain = recomputable(func, update_outputs, data)
    by_var = {b.var: b for b in bindings}
    outputs = set(func.body.body.fields)
    builder = relax.BlockBuilder()
    copies: dict[relax.Var, relax.Var] = {}
    order: list[relax.VarBinding] = []

    def copy(var):  # the recomputed twin of ``var``, emitted after its own operands' twins
        if var not in copies:
            for operand in _vars_in(by_var[var].value):
                if operand in chain:
                    copy(operand)
            value = builder.normalize(_rebuild(by_var[var].value, copies))
            copies[var] = relax.DataflowVar(f"{var.name}_re", value.ty)
            order.append(relax.VarBinding(copies[var], value))
        return copies[var]

    dropped = set()
    for b in bindings:
        if kinds[b.var] == "forward":
            order.append(b)
            continue
        # Forward outputs (new running statistics) stay: the step returns them anyway.
        reads = [v for v in _vars_in(b.value) if v in chain and v not in outputs]
        for v in reads:
            copy(v)
            dropped.add(v)
        value = _rebuild(b.value, {v: copies[v] for v in reads}) if reads else b.value
        order.append(relax.VarBinding(b.var, value))
    body = relax.SeqExpr([relax.DataflowBlock(order)], func.body.body)
    rewritten = relax.Function(func.params, body, func.body.body.ty, func.is_pure, func.attrs)
    return rewritten, len(dropped)


@tvm.transform.module_pass(opt_level=0, name="RecomputeActivations")
class RecomputeActivations:
    """``train_step`` with its cheap saved activations recomputed where backward reads them."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        signature = signature_of(mod)
        out["train_step"], _ = _recomputed(mod["train_step"], update_owners(signature),
                                           signature["data"])
        return out
