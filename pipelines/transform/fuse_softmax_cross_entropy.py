"""log_softmax, nll_loss, nll_loss_backward, exp, sum -> one softmax_nll_loss kernel call.

The cross-entropy loss and its gradient as one kernel call (kernels/softmax_nll.py). Autodiff
leaves a cross-entropy loss over logits ``z`` (rows x classes) and labels ``y`` as

    p  = log_softmax(z)                 dp = nll_loss_backward(g, p, y)
    loss = nll_loss(p, y)               s  = sum(dp, axis=-1, keepdims)
                                        dz = dp - exp(p) * s

When nothing else reads p, dp, s or exp(p), those bindings become one call of the fused kernel,
placed where dz was (after the loss adjoint g exists), which returns (dz, loss). A pattern
that differs in any way (weights, reduction "none", another reader) stays as it was.

Before::

    p = R.nn.log_softmax(z); loss = R.nn.nll_loss(p, y)
    dp = R.grad.nll_loss_backward(g, p, y); s = R.sum(dp, axis=[-1], keepdims=True)
    dz = R.subtract(dp, R.multiply(R.exp(p), s))

After::

    fused = R.call_tir(softmax_nll_loss, (z, y, g), out_sinfo=[dz type, loss type])
    dz = fused[0]; loss = fused[1]
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import block_of, readers, uses
from pipelines.ir import op_name as _op, static_float32_shape as _static, with_attrs_of
from pipelines.kernels.softmax_nll import softmax_nll_loss_kernel


def _last_axis(call, rank: int) -> bool:
    axes = [int(a) for a in call.attrs.axis] if call.attrs.axis is not None else []
    return axes in ([-1], [rank - 1]) and bool(call.attrs.keepdims)


def fused_losses(func: relax.Function) -> dict[relax.Var, dict]:
    """dz var -> what its fused call needs, for each cross-entropy pattern in ``func``."""
    bindings = block_of(func).bindings
    position = {b.var: n for n, b in enumerate(bindings)}
    value = {b.var: b.value for b in bindings}
    users = readers(bindings)
    returned = set(uses(func.body.body))

    def only_reader(var, op):
        reading = users[var]
        if len(reading) != 1 or var in returned or _op(value[reading[0]]) != op:
            return None
        return reading[0]

    found = {}
    for b in bindings:
        if _op(b.value) != "relax.nn.log_softmax" or b.var in returned:
            continue
        z = b.value.args[0]
        shape = _static(z)
        if shape is None or len(shape) != 2 or int(b.value.attrs.axis) not in (-1, 1):
            continue
        by_op = {_op(value[v]): v for v in users[b.var]}
        if len(users[b.var]) != 3 or set(by_op) != {
                "relax.nn.nll_loss", "relax.grad.nll_loss_backward", "relax.exp"}:
            continue
        loss, dp, exp = (by_op[op] for op in (
            "relax.nn.nll_loss", "relax.grad.nll_loss_backward", "relax.exp"))
        forward, backward = value[loss], value[dp]
        y = forward.args[1]
        if (len(forward.args) != 2 or len(backward.args) != 3 or not backward.args[1].same_as(b.var)
                or not backward.args[2].same_as(y) or not forward.args[0].same_as(b.var)
                or forward.attrs.reduction not in ("mean", "sum")
                or backward.attrs.reduction != forward.attrs.reduction
                or int(backward.attrs.ignore_index) != int(forward.attrs.ignore_index)):
            continue
        s = next((v for v in users[dp] if _op(value[v]) == "relax.sum"), None)
        if s is None or dp in returned or len(users[dp]) != 2 or not _last_axis(value[s], 2):
            continue
        product = only_reader(s, "relax.multiply")
        if product is None or only_reader(exp, "relax.multiply") != product \
                or {*value[product].args} != {s, exp}:
            continue
        dz = only_reader(product, "relax.subtract")
        if dz is None or list(value[dz].args) != [dp, product]:
            continue
        if any(position[v] < position[dz] for v in users[loss]):
            continue  # the loss is read before the fused call could stand
        found[dz] = {"logits": z, "labels": y, "adjoint": backward.args[0], "loss": loss,
                     "reduction": str(forward.attrs.reduction),
                     "ignore_index": int(forward.attrs.ignore_index),
                     "replaced": {b.var, loss, dp, s, exp, product}}
    return found


@relax.expr_functor.mutator
class _FusedLoss(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, found: dict):
        super().__init__(mod)
        self.found = found
        self.replaced = set().union(*(f["replaced"] for f in found.values()))

    def visit_var_binding_(self, binding):
        if binding.var in self.replaced:
            return  # read only by the fused call's pattern
        fused = self.found.get(binding.var)
        if fused is None:
            return super().visit_var_binding_(binding)
        rows, classes = _static(fused["logits"])
        kernel = self.builder_.add_func(softmax_nll_loss_kernel(
            rows, classes, fused["reduction"], fused["ignore_index"]), "softmax_nll_loss")
        args = [self.visit_expr(fused[k]) for k in ("logits", "labels", "adjoint")]
        call = self.builder_.emit(relax.call_tir(
            kernel, args, [binding.var.ty, fused["loss"].ty]), "softmax_nll_loss")
        # the original vars, bound here: whatever read them reads the fused call's results
        self.builder_.emit_normalized(relax.VarBinding(binding.var, relax.TupleGetItem(call, 0)))
        self.builder_.emit_normalized(relax.VarBinding(fused["loss"],
                                                       relax.TupleGetItem(call, 1)))


@tvm.transform.module_pass(opt_level=0, name="FuseSoftmaxCrossEntropy")
class FuseSoftmaxCrossEntropy:
    """Each cross-entropy pattern of ``train_step`` as one fused call (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        found = fused_losses(mod["train_step"])
        if not found:
            return mod
        mutator = _FusedLoss(mod.clone(), found)  # a copy: the builder updates it in place
        rewritten = mutator.visit_expr(mod["train_step"])
        out = mutator.builder_.get()
        out.update_func(out.get_global_var("train_step"), rewritten)
        return with_attrs_of(mod, out)
