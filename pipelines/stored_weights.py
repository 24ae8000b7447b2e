"""The frozen weights a step stores narrower (transform/store_frozen_weights.py narrows them): a
16-bit float, or 8-bit integers with a float32 scale per row. The signature's record of them,
the values the step starts from, and those it reads, which every twin of it starts from. Here
rather than in ir.py so that running a step needs no Relax."""
from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16 as a numpy dtype)
import numpy as np

# A step's signature keys: {input: dtype}, and {int8 input: the input holding its rows' scales}
STORED_AS = "stored_as"
SCALES = "scales"
INT8_MAX = 127  # symmetric: -127..127, so that negating a row keeps its scale


def scale_name(name: str) -> str:
    """The input holding int8 weight ``name``'s scales."""
    return f"{name}__scale"


def quantized(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` (float32, rows along axis 0) as int8 and a float32 scale per row: each row's
    largest magnitude becomes 127 (absmax, as LLM.int8's and QLoRA's per-row storage); a row of
    zeros has scale 1."""
    weight = np.asarray(weight, np.float32)
    rows = weight.reshape(weight.shape[0], -1)
    scale = np.abs(rows).max(axis=1) / np.float32(INT8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(rows / scale[:, None]), -INT8_MAX, INT8_MAX)
    return values.astype(np.int8).reshape(weight.shape), scale


def dequantized(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 weight int8 ``values`` with per-row ``scale`` stand for."""
    rows = np.asarray(values).reshape(len(scale), -1).astype(np.float32) * scale[:, None]
    return rows.reshape(np.shape(values))


def as_stored(signature: dict, values: dict) -> dict:
    """``values`` (numpy, by Relax name) as the step takes them: each weight it stores narrower
    in that dtype (numpy's float16, bfloat16 as ml_dtypes registers it, or int8 beside its
    scales' input)."""
    stored, out = signature.get(STORED_AS, {}), {}
    for name, value in values.items():
        if stored.get(name) == "int8":
            out[name], out[signature[SCALES][name]] = quantized(value)
        elif name in stored:
            out[name] = np.asarray(value).astype(stored[name])
        else:
            out[name] = value
    return out


def as_read(signature: dict, values: dict) -> dict:
    """The float32 values the step reads for ``values`` (by Relax name): a weight it stores
    narrower, rounded as it is stored. A twin of the step starts from these."""
    stored, step = signature.get(STORED_AS, {}), as_stored(signature, values)
    return {name: widened(signature, name, step) if name in stored else value
            for name, value in values.items()}


def widened(signature: dict, name: str, state: dict) -> np.ndarray:
    """Stored weight ``name`` of the step's ``state`` (numpy, as the step takes it) in float32."""
    if signature[STORED_AS][name] == "int8":
        return dequantized(state[name], np.asarray(state[signature[SCALES][name]]))
    return np.asarray(state[name], np.float32)
