"""scikit-learn's handwritten digits (real data, installed with scikit-learn), split for transfer
learning at the model's input size.

Pre-training sees only ``pretrain_classes``; fine-tuning sees ``finetune_classes`` (each split
into train and test). Images are upsampled (bilinear) from 8x8 to ``image_size`` and repeated
over ``channels``. With ``shift``, the fine-tuning training split also holds each of its images
moved ``shift`` pixels (at ``image_size``) in each of the 8 directions, the uncovered border
filled with the background: 9 times the examples. A model fine-tuned on 627 digits otherwise
learns the images rather than the digits (docs/schemes.md); the test split is never shifted.
"""
from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, NonNegativeInt, PositiveInt

from pipelines.schema import ConfigError, Strict

TASKS = ("classification",)  # the tasks its labels are for (fine-tuning checks it)
BACKGROUND = -1.0  # a blank pixel, normalised as the images are


class Config(Strict):
    """models.<name>.data with kind digits."""

    kind: Literal["digits"]
    image_size: PositiveInt
    channels: PositiveInt
    pretrain_classes: list[NonNegativeInt] = Field(min_length=1)
    finetune_classes: list[NonNegativeInt] = Field(min_length=1)
    test_fraction: Annotated[float, Field(gt=0, lt=1)]
    shift: NonNegativeInt = 0  # pixels the shifted copies of the fine-tuning images move


def shifted(images: np.ndarray, dy: int, dx: int, background: float) -> np.ndarray:
    """(N, C, H, W) ``images`` moved ``dy`` rows down and ``dx`` columns right."""
    out = np.full_like(images, background)
    h, w = images.shape[2:]
    out[:, :, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        images[:, :, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def make(cfg: Config, seed: int, source=None) -> dict[str, np.ndarray]:
    """The splits: {pretrain,finetune}_{train,test}_{x,y}."""
    import torch
    from sklearn.datasets import load_digits

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
    if cfg.shift:
        steps = (-cfg.shift, 0, cfg.shift)
        moves = [(dy, dx) for dy in steps for dx in steps]
        x = splits["finetune_train_x"]
        splits["finetune_train_x"] = np.concatenate([shifted(x, dy, dx, BACKGROUND)
                                                     for dy, dx in moves])
        splits["finetune_train_y"] = np.tile(splits["finetune_train_y"], len(moves))
    return splits
