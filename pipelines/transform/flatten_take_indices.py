"""take(data, indices[B, S]) -> reshape(take(data, reshape(indices, [B*S])), [B, S, D]).

An embedding lookup of a (batch, seq) token grid, or one row by a scalar index, becomes a
lookup by 1-D indices between two reshapes: TVM's gradient rule for ``take``
(``take_backward``) handles 1-D indices only. Same values. Run before the training graph is
built (training/graph.py).

Before::

    @R.function
    def main(tokens: R.Tensor((2, 8), "int64"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            lv = R.take(w, tokens, axis=0)                         # (2, 8, 32)
            ...

After::

    @R.function
    def main(tokens: R.Tensor((2, 8), "int64"), w: R.Tensor((64, 32), "float32")):
        with R.dataflow():
            lv_indices = R.reshape(tokens, R.shape([16]))
            lv_rows = R.take(w, lv_indices, axis=0)                # (16, 32)
            lv = R.reshape(lv_rows, R.shape([2, 8, 32]))
            ...
"""
from __future__ import annotations

import math

import tvm
from tvm import relax

from pipelines.ir import dtype_of, shape_of, tensor_type


def _is_grid_take(value) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.take" and len(shape_of(value.args[1])) != 1)


def _flattened(func: relax.Function) -> relax.Function:
    builder = relax.BlockBuilder()
    blocks = []
    for block in func.body.blocks:
        bindings = []
        for b in block.bindings:
            value = b.value
            if _is_grid_take(value):
                data, indices = value.args
                count = math.prod(shape_of(indices))
                flat = relax.DataflowVar(f"{b.var.name}_indices",
                                         tensor_type([count], dtype_of(indices)))
                bindings.append(relax.VarBinding(flat, builder.normalize(
                    relax.op.reshape(indices, [count]))))
                rows = builder.normalize(relax.op.take(data, flat, axis=int(value.attrs.axis),
                                                       mode=str(value.attrs.mode)))
                taken = relax.DataflowVar(f"{b.var.name}_rows", rows.ty)
                bindings.append(relax.VarBinding(taken, rows))
                value = builder.normalize(relax.op.reshape(taken, shape_of(b.var)))
            bindings.append(relax.VarBinding(b.var, value))
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="FlattenTakeIndices")
class FlattenTakeIndices:
    """Every Relax function's takes by a multi-dimensional index, by 1-D indices (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                out[gvar] = _flattened(func)
        return out
