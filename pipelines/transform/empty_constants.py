"""A constant with no elements -> ``R.zeros`` of its shape.

TVM 0.27 writes such a constant into the built executable but cannot load it back ("Invalid
DLTensor file format" when the step is loaded). Folding the gradient of an empty tensor (a
split's empty section) makes one. ``zeros`` of an
empty shape computes nothing and is no constant. Run on the optimized step, before the build
(backend/build.py).

Before::

    lv = R.add(x, R.const(np.zeros((2, 0)), "float32"))

After::

    lv0 = R.zeros(R.shape([2, 0]), "float32")
    lv = R.add(x, lv0)
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


@mutator
class _Rewriter(PyExprMutator):
    def visit_generic_const_(self, const: tvm.ir.expr.Constant) -> relax.Expr:
        value = const.value
        if not isinstance(value, tvm.runtime.Tensor) or 0 not in tuple(value.shape):
            return const
        return self.builder_.emit(relax.op.zeros(relax.ShapeExpr(list(value.shape)),
                                                 str(value.dtype)))


@relax.transform.function_pass(opt_level=0, name="EmptyConstantsAsZeros")
class EmptyConstantsAsZeros:
    """Every Relax function's empty constants, as zeros (above)."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        return _Rewriter(mod).visit_expr(func)
