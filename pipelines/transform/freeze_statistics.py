"""Batch norms of frozen layers -> normalised by their running statistics, which stay unchanged.

A model exported in training mode normalises every batch norm with the batch's statistics and
moves its running ones. For a layer the scheme freezes, that is not what a fine-tuner wants (a
batch of 8 gives noisy statistics, and a frozen layer's are what its weights were trained with):
PyTorch users put such layers in eval mode, timm freezes them (``freeze_batch_norm_2d``), and
the paper folds them into the convolutions. Given the scales (gamma, by Relax name) of the frozen
layers, each such batch norm becomes an eval-mode one, and the function returns its running
statistics as they came in (an importer computes their update apart from the batch norm, as
torch.export's does: dead code now). Run on ``main(*inputs, *params, *buffers) -> (logits,
*new_buffers)`` before the training graph is built (training/graph.py): the gradient rule of an
eval-mode batch norm is the plain affine one (training/rules.py: batch_norm_grad).

Before::

    lv = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True)
    y = lv[0]
    new_mean = R.add(R.multiply(mean, 0.9), ...)
    ...
    return (logits, new_mean, new_var)

After (``gamma`` frozen)::

    lv = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=False)
    y = lv[0]
    new_mean = R.add(R.multiply(mean, 0.9), ...)   # unused
    ...
    return (logits, mean, var)
"""
from __future__ import annotations

from collections.abc import Collection

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

def _training_norm(expr) -> bool:
    """A training-mode batch norm whose scale is a variable (a parameter)."""
    return (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name == "relax.nn.batch_norm" and bool(expr.attrs.training)
            and isinstance(expr.args[1], relax.Var))


def norm_scales(func: relax.Function) -> set[str]:
    """The Relax names of the scales of ``func``'s training-mode batch norms."""
    scales = set()

    def visit(expr):
        if _training_norm(expr):
            scales.add(expr.args[1].name)

    relax.analysis.post_order_visit(func, visit)
    return scales


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, frozen: Collection[str]):
        super().__init__(mod)
        self.frozen = frozen
        self.held: set[str] = set()  # the running statistics of the frozen batch norms

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (_training_norm(call) and call.args[1].name in self.frozen):
            return call
        self.held |= {call.args[3].name, call.args[4].name}
        attrs = call.attrs
        return relax.op.nn.batch_norm(*call.args, axis=int(attrs.axis),
                                      epsilon=float(attrs.epsilon), center=bool(attrs.center),
                                      scale=bool(attrs.scale), momentum=float(attrs.momentum),
                                      training=False)


def _returning_held(func: relax.Function, held: set[str]) -> relax.Function:
    """``func`` returning each held buffer as it came in, in place of its new value."""
    body = func.body
    fields = list(body.body.fields)
    buffers = func.params[len(func.params) - (len(fields) - 1):]
    for k, buffer in enumerate(buffers):
        if buffer.name in held:
            fields[1 + k] = buffer
    return relax.Function(func.params, relax.SeqExpr(body.blocks, relax.Tuple(fields)),
                          func.ret_ty, func.is_pure, func.attrs)


@relax.transform.function_pass(opt_level=0, name="FreezeStatistics")
class FreezeStatistics:
    """Each batch norm whose scale is one of ``frozen`` (Relax names) in eval mode (above)."""

    def __init__(self, frozen: Collection[str]):
        self.frozen = frozenset(frozen)

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        if not self.frozen:
            return func
        rewriter = _Rewriter(mod, self.frozen)
        return _returning_held(rewriter.visit_expr(func), rewriter.held)
