"""Seeded random token ids and next-token labels: synthetic, for timing a language model's step
(speed and memory, never quality)."""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import PositiveInt

from pipelines.schema import Strict

TASKS = ()  # the tasks its labels are for: none, random labels teach nothing (timing only)


class Config(Strict):
    """models.<name>.data with kind tokens."""

    kind: Literal["tokens"]
    vocab: PositiveInt
    seq_len: PositiveInt
    examples: PositiveInt


def make(cfg: Config, seed: int, source=None) -> dict[str, np.ndarray]:
    """``cfg.examples`` sequences of ``cfg.seq_len`` tokens, and per token a label drawn the
    same way."""
    rng = np.random.default_rng(seed)
    shape = (cfg.examples, cfg.seq_len)
    return {"train_x": rng.integers(0, cfg.vocab, shape), "train_y": rng.integers(0, cfg.vocab, shape),
            "train_attention_mask": np.ones(shape, np.int64)}  # no padding
