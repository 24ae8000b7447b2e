"""R.power(x, 2.0) -> R.multiply(x, x); R.power(x, 1.0) -> x.

RMS norm squares its input, and its gradient is 2 * x ** 1 by the power rule; as kernels these
are powf calls per element, whose exponent (a constant the fusion passes in as a buffer) LLVM
cannot see: 1.75 ms of the llama_tiny transformer_paper step's 50 ms went to its four RMS norm
gradients. Run after FoldConstant (the gradient's exponent 2 - 1 becomes the constant 1).

Before::

    sq = R.power(x, R.const(2.0, "float32"))
    g = R.multiply(dy, R.power(x, R.const(1.0, "float32")))

After::

    sq = R.multiply(x, x)
    g = R.multiply(dy, x)
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from pipelines.ir import with_attrs_of


@relax.expr_functor.mutator
class _PlainPowers(relax.PyExprMutator):
    """Rewrites one call at a time (the module docstring says why)."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.power" or not isinstance(
                call.args[1], tvm.ir.expr.Constant) or call.args[1].value.numpy().ndim:
            return call
        base, exponent = call.args[0], float(call.args[1].value.numpy())
        if exponent == 1.0 and tvm_ffi.structural_equal(base.ty, call.ty):
            return base
        if exponent == 2.0:
            return relax.op.multiply(base, base)
        return call


@tvm.transform.module_pass(opt_level=0, name="PlainPowers")
class PlainPowers:
    """Every Relax function's x ** 2 and x ** 1 as x * x and x (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _PlainPowers(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        return with_attrs_of(mod, mutator.builder_.get())
