"""equal / not_equal of two bool tensors, and cumsum of one -> the same op on int8 casts.

TVM 0.27's LLVM code generator compares bool values with a floating-point ``fcmp`` and adds
them with a floating-point add, both of which LLVM rejects for ``i1`` ("fcmp oeq i1"). Such ops
come from attention masks: Hugging Face transformers builds its padding mask as
``mask[i] == mask[j]`` and TVM's importer turns a mask's running "any" into a bool cumsum. Same
values (a bool cumsum is True from the first True on). Run before the training graph is built
(training/graph.py).

Before::

    @R.function
    def main(m: R.Tensor((4, 16), "bool")):
        with R.dataflow():
            lv = R.equal(R.expand_dims(m, [2]), R.expand_dims(m, [1]))   # bool == bool
            ...

After::

    @R.function
    def main(m: R.Tensor((4, 16), "bool")):
        with R.dataflow():
            lv = R.equal(R.astype(R.expand_dims(m, [2]), "int8"),
                         R.astype(R.expand_dims(m, [1]), "int8"))
            ...

    lv = R.cumsum(m, axis=-1)                       # bool
    ->
    lv = R.astype(R.cumsum(R.astype(m, "int8"), axis=-1, dtype="int32"), "bool")
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipelines.ir import dtype_of

_COMPARISONS = ("relax.equal", "relax.not_equal")
_BOOL = "bool"


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.name in _COMPARISONS and all(dtype_of(a) == _BOOL for a in call.args):
            ints = [self.builder_.emit(relax.op.astype(arg, "int8")) for arg in call.args]
            return relax.Call(call.op, ints, call.attrs)
        if call.op.name == "relax.cumsum" and dtype_of(call.args[0]) == _BOOL:
            ints = self.builder_.emit(relax.op.astype(call.args[0], "int8"))
            axis = call.attrs.axis
            total = self.builder_.emit(relax.op.cumsum(
                ints, None if axis is None else int(axis), "int32", bool(call.attrs.exclusive)))
            return relax.op.astype(total, _BOOL)
        return call


@relax.transform.function_pass(opt_level=0, name="BoolOpsAsInts")
class BoolOpsAsInts:
    """Every Relax function's comparisons and cumsums of bool tensors, on int casts (above)."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        return _Rewriter(mod).visit_expr(func)
