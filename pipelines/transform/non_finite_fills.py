"""R.full / R.full_like with an infinite or NaN fill -> R.broadcast_to of that constant.

TVM 0.27's legalization of ``full`` tests a non-finite fill's dtype as a string, and the
dtype it is given is not one: "argument of type 'PrimType' is not iterable". PyTorch masks
attention so (``torch.full_like(scores, -inf)``, and TVM's ``masked_fill`` conversion is a
``full_like``: LLaMA 4's chunked attention, DeepSeek V4's). ``broadcast_to`` of the constant
is the same tensor. Run on the imported model, before the gradient (compile.py).

Before::

    lv = R.full(R.shape([2, 8]), R.const(-inf, "float32"), dtype="float32")

After::

    lv = R.broadcast_to(R.const(-inf, "float32"), R.shape([2, 8]))
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipelines.ir import dtype_of, shape_of


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") not in ("relax.full", "relax.full_like"):
            return call
        fill = call.args[1]  # full(shape, fill), full_like(x, fill)
        if not isinstance(fill, tvm.ir.expr.Constant) or fill.value.numpy().ndim:
            return call
        value = float(fill.value.numpy())
        if math.isfinite(value):
            return call
        return relax.op.broadcast_to(relax.const(value, dtype_of(call)),
                                     relax.ShapeExpr(shape_of(call)))


@relax.transform.function_pass(opt_level=0, name="NonFiniteFills")
class NonFiniteFills:
    """Every Relax function's non-finite fills, as broadcasts of the constant (above)."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        return _Rewriter(mod).visit_expr(func)
