"""Relax IR on disk: JSON for the next stage to load, TVMScript text for people to read."""
from __future__ import annotations

from pathlib import Path

import tvm

from pipelines.artifacts import write_text_atomic


def save_ir(mod: tvm.IRModule, directory: Path, stem: str) -> None:
    write_text_atomic(Path(directory) / f"{stem}.json", tvm.ir.save_json(mod))
    write_text_atomic(Path(directory) / f"{stem}.relax.py", mod.script(show_meta=False))


def load_ir(path: Path) -> tvm.IRModule:
    return tvm.ir.load_json(Path(path).read_text())


def count_ops(func) -> dict[str, int]:
    """Operator name -> number of calls in a Relax function (TIR calls by callee name)."""
    from tvm import relax

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


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _tensor_shapes(ty) -> list[list[int]]:
    from tvm import relax

    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return [[int(d) for d in ty.shape.values]]
    if isinstance(ty, relax.TupleType):
        return [s for field in ty.fields for s in _tensor_shapes(field)]
    return []


def op_cost(call) -> tuple[int, int]:
    """(FLOPs, bytes written) of one high-level Relax call, before legalization.

    Convolutions and matmuls count 2 FLOPs per multiply-accumulate; other ops one per output
    element. Bytes are the float32 sizes of the values the call produces."""
    from tvm import relax

    out_shapes = _tensor_shapes(call.ty)
    written = sum(4 * _numel(s) for s in out_shapes)
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
    if name in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
        w = [int(d) for d in call.args[1].ty.shape.values]
        data = [int(d) for d in call.args[0].ty.shape.values]
        out = out_shapes[0]
        groups = int(call.attrs.groups)
        if name == "relax.nn.conv2d":
            layout = str(call.attrs.data_layout)
            cin = data[layout.index("C")]
            macs = _numel(out) * (cin // groups) * w[2] * w[3]
        else:  # transpose: every input element meets a (cout/groups x kh x kw) slice
            macs = _numel(data) * (w[1]) * w[2] * w[3]
        return 2 * macs, written
    if name == "relax.matmul":
        k = int(call.args[0].ty.shape.values[-1])
        return 2 * _numel(out_shapes[0]) * k, written
    return sum(_numel(s) for s in out_shapes), written


def graph_cost(func) -> dict:
    """Op count, FLOPs and bytes produced by every call bound in ``func``."""
    from tvm import relax

    ops = flops = written = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                f, b = op_cost(value)
                ops, flops, written = ops + 1, flops + f, written + b
    return {"ops": ops, "flops": flops, "bytes_produced": written}
