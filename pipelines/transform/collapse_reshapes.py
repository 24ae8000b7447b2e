"""reshape(reshape(x)) -> reshape(x) where nothing else reads the inner one; a reshape to x's
own shape -> x.

IsolateGemms gives the LM head's product as ``[batch * seq, vocab]`` reshaped to the model's
``[batch, seq, vocab]``, which the loss reshapes back to rows; fused, the pair is a kernel that
copies the logits (and another their gradient). Relax's RemoveRedundantReshape collapses every
such pair, also where the inner reshape has other readers (attention's masked probabilities,
read in both shapes): the backward pass then reads the forward's probabilities instead of their
recomputed copy and keeps them (docs/llm.md has the figures). Here a pair collapses only where
the inner reshape is read by the outer one alone, so no reader moves to another tensor.

Before::

    h = R.reshape(logits_rows, [2, 256, 49152]); z = R.reshape(h, [512, 49152])
After::

    z = logits_rows
"""
from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

from pipelines.analysis.liveness import block_of, uses
from pipelines.ir import op_name, with_attrs_of


def _shape(expr) -> list[int] | None:
    shape = getattr(expr.ty, "shape", None)
    try:
        return None if shape is None else [int(d) for d in shape]
    except TypeError:  # a symbolic dimension
        return None


@tvm.transform.module_pass(opt_level=0, name="CollapseReshapes")
class CollapseReshapes:
    """Each reshape of a reshape read by it alone collapsed (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["train_step"]
        bindings = list(block_of(func).bindings)
        readers = Counter(v for b in bindings for v in uses(b.value))
        readers.update(uses(func.body.body))
        value = {b.var: b.value for b in bindings}
        changed = {}
        for b in bindings:
            inner = b.value.args[0] if op_name(b.value) == "relax.reshape" else None
            if inner not in value or op_name(value[inner]) != "relax.reshape" \
                    or readers[inner] != 1:
                continue
            source = value[inner].args[0]
            shape = _shape(b.var)
            if shape is not None and shape == _shape(source):
                changed[b.var] = source
            else:
                changed[b.var] = relax.op.reshape(source, b.value.args[1])
            value[b.var] = changed[b.var]  # a chain of three collapses in turn
        if not changed:
            return mod
        rewritten = [relax.VarBinding(b.var, changed[b.var]) if b.var in changed else b
                     for b in bindings]
        body = relax.SeqExpr([relax.DataflowBlock(rewritten)], func.body.body)
        out = mod.clone()
        out.update_func(out.get_global_var("train_step"), relax.Function(
            func.params, body, func.body.body.ty, func.is_pure, func.attrs))
        out = relax.transform.DeadCodeElimination(["train_step"])(relax.transform.Normalize()(out))
        return with_attrs_of(mod, out)
