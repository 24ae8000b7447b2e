"""The frozen weights a step stores in a 16-bit float (transform/store_frozen_weights.py
narrows them): the signature's record of them, and the values the step and every twin of it
start from. Here rather than in ir.py so that running a step needs no Relax."""
from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16 as a numpy dtype)
import numpy as np

# A step's signature key, {input: dtype}
STORED_AS = "stored_as"


def as_stored(signature: dict, values: dict) -> dict:
    """``values`` (numpy, by Relax name) with each weight the step stores narrower rounded to
    that dtype (numpy's float16, or bfloat16 as ml_dtypes registers it)."""
    stored = signature.get(STORED_AS, {})
    return {name: np.asarray(value).astype(stored[name]) if name in stored else value
            for name, value in values.items()}
