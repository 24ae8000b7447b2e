"""A split with an empty section -> one strided_slice per section.

TVM 0.27's ``topi.split`` refuses split points that are not strictly increasing ("split_indices
must be sorted"), so a split with an empty section, which PyTorch allows
(``torch.split(x, [0, 8])``, a shrunk config's zero-width rotary part), imports and
differentiates but does not build. Each section as its own slice computes the same tensors,
empty ones included. Run before the training graph is built (compile.py: training_graph).

Before::

    lv = R.split(x, indices_or_sections=[0], axis=-1)        # x: (2, 8)

After::

    lv = (R.strided_slice(x, [1], [0], [0]), R.strided_slice(x, [1], [0], [8]))
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from pipelines.ir import shape_of


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.split"):
            return call
        points = call.attrs.indices_or_sections
        if not isinstance(points, (tvm.ir.Array, list, tuple)):
            return call  # equal sections: never empty
        x, axis = call.args[0], int(call.attrs.axis)
        size = shape_of(x)[axis]
        bounds = [0, *(min(int(p), size) for p in points), size]
        if all(a < b for a, b in zip(bounds, bounds[1:])):
            return call
        return relax.Tuple([self.builder_.emit(relax.op.strided_slice(x, [axis], [a], [b]))
                            for a, b in zip(bounds, bounds[1:])])


@relax.transform.function_pass(opt_level=0, name="SplitAsSlices")
class SplitAsSlices:
    """Every Relax function's splits with an empty section, as slices (above)."""

    def transform_function(self, func: relax.Function, mod: tvm.IRModule, _ctx):
        return _Rewriter(mod).visit_expr(func)
