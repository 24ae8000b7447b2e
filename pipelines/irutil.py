"""Small helpers over TVM 0.27's Relax types (StructInfo became ``Type``: ``var.ty``)."""
from __future__ import annotations

from tvm import relax


def shape_of(expr: relax.Expr) -> list[int]:
    """Static shape of a tensor-typed Relax expression."""
    return [int(d) for d in expr.ty.shape.values]


def dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype.dtype)


def tensor_type(shape, dtype: str) -> relax.TensorType:
    return relax.TensorType(list(shape), dtype)
