"""Relax IR helpers the whole library shares: types (TVM 0.27 renamed StructInfo to ``Type``:
``var.ty``), sizes, and IR on disk (JSON for the next stage, TVMScript for people)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import tvm
from tvm import relax

from pipelines.io import read_json, verified, write_text_atomic

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


def op_name(value) -> str:
    """The operator a Relax value calls ("relax.matmul"), or "" for anything else."""
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        else ""


def static_float32_shape(expr) -> list[int] | None:
    """A float32 tensor's static shape, or None (another dtype, or a symbolic dimension)."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None or expr.ty.dtype != "float32":
        return None
    try:
        return [int(d) for d in shape]
    except TypeError:  # a symbolic dimension
        return None


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
    """``<stem>.json`` for the next stage, ``<stem>.relax.py`` (TVMScript) for people, and the
    training-step signature, if the module carries one, as ``signature.json``."""
    directory = Path(directory)
    if mod.attrs and SIGNATURE in mod.attrs:
        write_text_atomic(directory / "signature.json",
                          json.dumps(signature_of(mod), indent=1, sort_keys=True) + "\n")
        mod = without_signature(mod)
    write_text_atomic(directory / f"{stem}.json", tvm.ir.save_json(mod))
    write_text_atomic(directory / f"{stem}.relax.py", mod.script(show_meta=False))


def load_ir(path: Path) -> tvm.IRModule:
    """A module saved by save_ir, with the signature beside it attached, if there is one."""
    path = Path(path)
    mod = tvm.ir.load_json(verified(path).read_text())
    signature = path.with_name("signature.json")
    return with_signature(mod, read_json(signature)) if signature.exists() else mod


# A training step's signature (training/graph.py: its inputs and outputs by name, what each
# optimizer-state input holds, what trains) travels with the module in memory, as a module
# attribute, so the passes that need it are plain module -> module passes. On disk it is
# signature.json beside the TVMScript (save_ir and load_ir), which stays free of it.
SIGNATURE = "pock_signature"
# A lowered main's attribute, {embedding weight: row}: the row its frontend's framework never
# updates (PyTorch's padding_idx); the training step leaves it out of the gradient.
PADDING_ROWS = "pock_padding_rows"
# A lowered main's attribute, [parameter]: those its framework holds fixed (PyTorch's
# requires_grad=False: a sinusoidal position table); no scheme trains them.
FIXED_PARAMETERS = "pock_fixed_parameters"


def signature_of(mod: tvm.IRModule) -> dict:
    if not mod.attrs or SIGNATURE not in mod.attrs:
        raise ValueError("the module carries no training-step signature (ir.with_signature)")
    return json.loads(str(mod.attrs[SIGNATURE]))


def with_signature(mod: tvm.IRModule, signature: dict) -> tvm.IRModule:
    return mod.with_attr(SIGNATURE, json.dumps(signature, sort_keys=True))


def without_signature(mod: tvm.IRModule) -> tvm.IRModule:
    return mod.without_attr(SIGNATURE) if mod.attrs and SIGNATURE in mod.attrs else mod


def with_attrs_of(source: tvm.IRModule, out: tvm.IRModule) -> tvm.IRModule:
    """``out`` with ``source``'s module attributes (a mutator's builder starts without them)."""
    for key, value in (source.attrs or {}).items():
        out = out.with_attr(key, value)
    return out
