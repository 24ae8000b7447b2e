"""The logits' gradient written over the logits: the fused loss kernel made in place where
nothing reads the logits after it.

The fused softmax cross-entropy (kernels/softmax_nll.py) reads the logits and writes their
gradient, each rows x classes floats (a language model's vocabulary wide), both alive at the
kernel, at the start of the backward pass, where a sparse step's memory peaks. The kernel reads
each logit only before or where it writes that logit's gradient, so where nothing reads the
logits (or a view of their storage) after the call, its call becomes ``call_tir_inplace``: the
gradient takes the logits' storage, as update_in_place.py does for the state.

Before::

    fused = R.call_tir(softmax_nll_loss, (z, y, g), out_sinfo=[dz type, loss type])
After::

    fused = R.call_tir_inplace(softmax_nll_loss_inplace, (z, y, g), inplace_indices=[0, -1],
                               out_sinfo=[dz type, loss type])     # dz in z's storage
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import block_of, uses
from pipelines.ir import op_name, with_attrs_of
from pipelines.kernels.softmax_nll import LOSS_KERNEL
from pipelines.transform.update_in_place import storage_views, writes_safely_over, written_over

LOGITS, GRADIENT = 0, 3  # the fused kernel's parameters: logits, labels, adjoint, gradient, loss


def _dies_at(var: relax.Var, position: int, bindings, views: dict, returned: set) -> bool:
    """Whether ``var``'s storage is a kernel's output in the step and nothing reads it, or a
    view of it, after binding ``position``."""
    roots = views.get(var, {var})
    made = {b.var for b in bindings if isinstance(b.value, relax.Call)}
    if not roots <= made:
        return False  # a parameter (the caller's tensor), or a tuple's field read elsewhere too
    sharing = roots | {v for v, r in views.items() if r & roots}
    return not (sharing & returned) and not any(
        sharing & set(uses(b.value)) for b in bindings[position + 1:])


@tvm.transform.module_pass(opt_level=0, name="LossGradientInPlace")
class LossGradientInPlace:
    """Each fused loss call whose logits die at it writes their gradient over them (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["train_step"]
        bindings = list(block_of(func).bindings)
        views = storage_views(mod, block_of(func))
        returned = set(uses(func.body.body))
        builder, changed, made = relax.BlockBuilder(mod.clone()), {}, {}
        for n, b in enumerate(bindings):
            call = b.value
            if op_name(call) != "relax.call_tir" or len(call.args) != 2:
                continue
            kernel = mod[call.args[0]]
            if LOSS_KERNEL not in (kernel.attrs or {}) or len(kernel.params) != 5:
                continue
            logits, gradient = kernel.params[LOGITS], kernel.params[GRADIENT]
            if not (_dies_at(call.args[1].fields[LOGITS], n, bindings, views, returned)
                    and writes_safely_over(kernel, logits, gradient)):
                continue
            name = call.args[0].name_hint
            if name not in made:
                made[name] = builder.add_func(written_over(kernel, {gradient: logits}),
                                              f"{name}_inplace")
            changed[b.var] = relax.call_tir_inplace(made[name], call.args[1], [LOGITS, -1],
                                                    list(call.ty.fields))
        if not changed:
            return mod
        rewritten = [relax.VarBinding(b.var, changed[b.var]) if b.var in changed else b
                     for b in bindings]
        body = relax.SeqExpr([relax.DataflowBlock(rewritten)], func.body.body)
        builder.update_func(mod.get_global_var("train_step"), relax.Function(
            func.params, body, func.body.body.ty, func.is_pure, func.attrs))
        # the kernel with an output of its own is called no more
        return relax.transform.DeadCodeElimination(["train_step"])(
            with_attrs_of(mod, builder.get()))
