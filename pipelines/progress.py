"""Progress bars for the long phases (fine-tuning, benchmarking, comparing and searching
schemes). Shown on a terminal only: logs (CI, `dvc repro` piped) keep the stages' own lines."""
from __future__ import annotations

import sys

import numpy as np


def progress(iterable, desc: str, total: int | None = None, unit: str = "it",
             scale: int = 1):
    """``iterable`` with a bar: each item ``scale`` ``unit`` (a fine-tuning step: its tokens
    or images), so the bar shows their rate and the time left."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False, file=sys.stderr,
                dynamic_ncols=True, unit=unit, unit_scale=scale if scale != 1 else False)


def throughput_unit(x: np.ndarray, batch: int) -> tuple[str, int]:
    """What a progress bar counts a training step on ``batch`` rows of ``x`` in: tokens
    (token ids), images, or examples; and how many of them a step is."""
    if np.issubdtype(x.dtype, np.integer) and x.ndim == 2:
        return "tok", batch * x.shape[1]
    return ("img" if x.ndim == 4 else "ex"), batch
