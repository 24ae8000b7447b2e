"""Seeded random token ids and next-token labels: synthetic, for timing a language model's step
(speed and memory, never quality)."""
from __future__ import annotations

import numpy as np


def make(cfg, seed: int) -> dict[str, np.ndarray]:
    """``cfg.examples`` sequences of ``cfg.seq_len`` tokens (pipelines/config.py: Tokens), and per
    token a label drawn the same way."""
    rng = np.random.default_rng(seed)
    shape = (cfg.examples, cfg.seq_len)
    return {"train_x": rng.integers(0, cfg.vocab, shape), "train_y": rng.integers(0, cfg.vocab, shape),
            "train_attention_mask": np.ones(shape, np.int64)}  # no padding
