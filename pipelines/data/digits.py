"""scikit-learn's handwritten digits (real data, installed with scikit-learn), split for transfer
learning at the model's input size.

Pre-training sees only ``pretrain_classes``; fine-tuning sees ``finetune_classes`` (each split
into train and test). Images are upsampled (bilinear) from 8x8 to ``image_size`` and repeated
over ``channels``.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

from pipelines.config import ConfigError


def make(cfg, seed: int) -> dict[str, np.ndarray]:
    """The splits of pipelines/config.py's Digits: {pretrain,finetune}_{train,test}_{x,y}."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    size = cfg.image_size
    images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear",
                                             align_corners=False)
    images = ((images - 0.5) / 0.5).repeat(1, cfg.channels, 1, 1).numpy()
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    splits = {}
    for part in ("pretrain", "finetune"):
        classes = getattr(cfg, f"{part}_classes")
        bad = [c for c in classes if not 0 <= c <= 9]
        if bad:
            raise ConfigError(f"params.yaml: data.{part}_classes={classes}; allowed: digits "
                              "0..9")
        index = np.flatnonzero(np.isin(labels, classes))
        rng.shuffle(index)
        n_test = int(round(len(index) * cfg.test_fraction))
        for name, idx in (("test", index[:n_test]), ("train", index[n_test:])):
            splits[f"{part}_{name}_x"] = images[idx]
            splits[f"{part}_{name}_y"] = labels[idx]
    return splits
