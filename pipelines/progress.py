"""Progress bars for the long phases (fine-tuning, benchmarking, comparing and searching
schemes). Shown on a terminal only: logs (CI, `dvc repro` piped) keep the stages' own lines."""
from __future__ import annotations

import sys


def progress(iterable, desc: str, total: int | None = None):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False, file=sys.stderr,
                dynamic_ncols=True)
