"""Progress bars for the long phases (fine-tuning, benchmarking, comparing and searching
schemes). Shown on a terminal only: logs (CI, `dvc repro` piped) keep the stages' own lines."""
from __future__ import annotations

import sys


def progress(iterable, desc: str, total: int | None = None, unit: str = "it",
             scale: int = 1):
    """``iterable`` with a bar: each item ``scale`` ``unit`` (a fine-tuning step: its tokens
    or images), so the bar shows their rate and the time left."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False, file=sys.stderr,
                dynamic_ncols=True, unit=unit, unit_scale=scale if scale != 1 else False)
