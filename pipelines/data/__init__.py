"""The data a model is trained and timed on (a model's ``data`` section, by ``kind``): scikit-learn's
digits (real), the synthetic text task, synthetic tokens. Every kind gives arrays named
``<split>_x`` (inputs) and ``<split>_y`` (labels); the splits that fine-tuning reads are
``finetune_train`` and ``finetune_test``, the one a step is timed on is the first of
``finetune_train``, ``train``.
"""
from __future__ import annotations

import numpy as np

from pipelines.data import digits, sentences, tokens

MAKERS = {"digits": digits.make, "sentences": sentences.make, "tokens": tokens.make}
FILE = "data.npz"


def make_data(cfg, seed: int) -> dict[str, np.ndarray]:
    """The arrays of ``cfg`` (a Digits, Sentences or Tokens config), seeded."""
    return MAKERS[cfg.kind](cfg, seed)


def split(data: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    return data[f"{name}_x"], data[f"{name}_y"]


def timing_batch(data: dict, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``batch_size`` examples of the training split: what a step is timed on."""
    name = next(n for n in ("finetune_train", "train") if f"{n}_x" in data)
    x, y = split(data, name)
    return np.ascontiguousarray(x[:batch_size]), np.ascontiguousarray(y[:batch_size])
