"""Relax IR helpers every room shares: types (TVM 0.27 renamed StructInfo to ``Type``:
``var.ty``), sizes and costs, and IR on disk (JSON for the next stage, TVMScript for people)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import tvm
from tvm import relax

from pipelines.artifacts import write_text_atomic

# relax OpPatternKind kOpaque, as a kernel's "op_pattern": FuseOps fuses nothing into it
OPAQUE = 8


def shape_of(expr_or_type) -> list[int]:
    """Static shape of a tensor-typed Relax expression (or of a TensorType)."""
    ty = getattr(expr_or_type, "ty", expr_or_type)
    return [int(d) for d in ty.shape.values]


def dtype_of(expr_or_type) -> str:
    ty = getattr(expr_or_type, "ty", expr_or_type)
    return str(ty.dtype.dtype)


def nbytes(expr_or_type) -> int:
    return tvm.runtime.DataType(dtype_of(expr_or_type)).bits // 8 * math.prod(
        shape_of(expr_or_type))


def tensor_type(shape, dtype: str) -> relax.TensorType:
    return relax.TensorType(list(shape), dtype)


def identifier(name: str, taken: set[str]) -> str:
    """A valid Relax variable name for a frontend's tensor name ("features.0.weight" ->
    "features_0_weight"), unique among ``taken`` (which it joins)."""
    base = re.sub(r"\W", "_", name.removeprefix("onnx::")) or "tensor"
    base = base if base[0].isalpha() or base[0] == "_" else f"t_{base}"
    unique, i = base, 1
    while unique in taken:
        unique, i = f"{base}_{i}", i + 1
    taken.add(unique)
    return unique


def save_ir(mod: tvm.IRModule, directory: Path, stem: str) -> None:
    write_text_atomic(Path(directory) / f"{stem}.json", tvm.ir.save_json(mod))
    write_text_atomic(Path(directory) / f"{stem}.relax.py", mod.script(show_meta=False))


def load_ir(path: Path) -> tvm.IRModule:
    return tvm.ir.load_json(Path(path).read_text())


def count_ops(func) -> dict[str, int]:
    """Operator name -> number of calls in a Relax function (TIR calls by callee name)."""
    counts: dict[str, int] = {}

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            name = op.name if isinstance(op, tvm.ir.Op) else getattr(op, "name_hint", str(op))
            if name in ("relax.call_tir", "relax.call_tir_inplace"):
                name = expr.args[0].name_hint
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    return dict(sorted(counts.items()))


def _tensor_types(ty) -> list[relax.TensorType]:
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return [ty]
    if isinstance(ty, relax.TupleType):
        return [t for field in ty.fields for t in _tensor_types(field)]
    return []


def op_cost(call) -> tuple[int, int]:
    """(FLOPs, bytes written) of one high-level Relax call, before legalization.

    Convolutions and matmuls count 2 FLOPs per multiply-accumulate; other ops one per output
    element. Bytes are the sizes of the values the call produces."""
    outs = _tensor_types(call.ty)
    written = sum(nbytes(t) for t in outs)
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
    if name in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
        data, w = shape_of(call.args[0]), shape_of(call.args[1])
        if name == "relax.nn.conv2d":
            cin = data[str(call.attrs.data_layout).index("C")]
            macs = math.prod(shape_of(outs[0])) * (cin // int(call.attrs.groups)) * w[2] * w[3]
        else:  # transpose: every input element meets a (cout/groups x kh x kw) slice
            macs = math.prod(data) * w[1] * w[2] * w[3]
        return 2 * macs, written
    if name == "relax.matmul":
        return 2 * math.prod(shape_of(outs[0])) * shape_of(call.args[0])[-1], written
    return sum(math.prod(shape_of(t)) for t in outs), written


def graph_cost(func) -> dict:
    """Op count, FLOPs and bytes produced by every call bound in ``func``."""
    ops = flops = written = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                f, b = op_cost(value)
                ops, flops, written = ops + 1, flops + f, written + b
    return {"ops": ops, "flops": flops, "bytes_produced": written}
