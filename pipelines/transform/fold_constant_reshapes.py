"""A reshape or broadcast of a constant -> the constant of its result, computed with numpy.

StableHLO (the JAX and Keras frontends) spells every scalar in elementwise arithmetic as a
constant reshaped and broadcast to its operand's shape. Relax's FoldConstant folds each of them
too, but by legalizing the call and building its kernel with LLVM: for Keras MobileNetV2 that is
over a thousand builds, most of its optimize time. This pass does the same folds (same values,
same shapes) by copying, so FoldConstant, run after it, only builds for real arithmetic.

Before::

    lv6 = R.reshape(R.const(1024.0, "float32"), R.shape([1, 1, 1, 1]))
    lv7 = R.broadcast_to(lv6, R.shape([1, 1, 1, 16]))
    lv8 = R.divide(x, lv7)

After::

    lv8 = R.divide(x, R.const(np.full((1, 1, 1, 16), 1024.0), "float32"))
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm
from tvm.relax.expr_functor import PyExprMutator, mutator

# ops whose result is their input's elements in order, in another shape; and broadcast_to
RESHAPES = {"relax.reshape", "relax.expand_dims", "relax.squeeze"}
BROADCAST = "relax.broadcast_to"


@mutator
class _Folder(PyExprMutator):
    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        if isinstance(expr, relax.Var):
            expr = self.lookup_binding(expr)
        if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
            return expr.value.numpy()
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = getattr(call.op, "name", "")
        if name not in RESHAPES and name != BROADCAST:
            return call
        value = self._constant(call.args[0])
        shape = getattr(self.builder_.normalize(call).ty, "shape", None)
        if value is None or shape is None or not all(
                isinstance(dim, IntImm) for dim in shape.values):
            return call
        shape = tuple(int(dim) for dim in shape.values)
        folded = np.broadcast_to(value, shape) if name == BROADCAST else value.reshape(shape)
        return relax.const(np.ascontiguousarray(folded), str(value.dtype))


@relax.transform.function_pass(opt_level=0, name="FoldConstantReshapes")
class FoldConstantReshapes:
    """Every Relax function's reshapes and broadcasts of constants, folded (above)."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        return _Folder(mod).visit_expr(func)
