"""The user's image folder for a vision model: ``<folder>/<class name>/*.png|jpg``, a class per
sub-folder (in sorted order), each image read as RGB (or grey for a one-channel model), resized
to the model's image size and normalised with its mean and standard deviation: the model
directory's preprocessor_config.json (``image_mean``, ``image_std``, ``size``) where it has one,
else the config's ``image_size``, else this section's keys (ImageNet's statistics by default).
The held-out images are a seeded share of each class.

    models.<name>.data: {kind: images, files: data/flowers}
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data.files import fit_head, held_out, relative, user_files
from pipelines.schema import ConfigError, Strict

KEY = "models.<name>.data"
SUFFIXES = (".png", ".jpg", ".jpeg")
IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

TASKS = ("classification",)  # the tasks its labels are for (fine-tuning checks it)


class Config(Strict):
    """models.<name>.data with kind images."""

    kind: Literal["images"]
    files: str  # a folder under data/, a sub-folder per class
    image_size: PositiveInt | None = None  # default: the model's
    channels: Literal[1, 3] = 3
    mean: list[float] | None = None  # per channel (default: the model's, or ImageNet's)
    std: list[float] | None = None
    held_out: float = Field(0.2, gt=0, lt=1)  # the share of each class scored


def preprocessing(cfg: Config, source) -> tuple[int, np.ndarray, np.ndarray]:
    """(image size, mean, std) as the model's preprocessing says, this section's keys first."""
    config = source.config
    size = config.get("size", {})
    size = cfg.image_size or (size.get("height") or size.get("shortest_edge")
                              if isinstance(size, dict) else size) or config.get("image_size")
    if not size:
        raise ConfigError(f"{KEY}.image_size: the model says no image size; set it")
    mean = cfg.mean or config.get("image_mean") or IMAGENET[0]
    std = cfg.std or config.get("image_std") or IMAGENET[1]
    if cfg.channels == 1:
        mean, std = mean[:1], std[:1]
    if len(mean) != cfg.channels or len(std) != cfg.channels:
        raise ConfigError(f"{KEY}.mean / std: one value per channel ({cfg.channels})")
    shape = (1, cfg.channels, 1, 1)
    return int(size), np.reshape(mean, shape).astype(np.float32), np.reshape(std, shape).astype(
        np.float32)


def load(path, size: int, channels: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image = image.convert("RGB" if channels == 3 else "L").resize(
                (size, size), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as err:
        raise ConfigError(f"{relative(path)}: not an image ({err}); allowed: "
                          f"{list(SUFFIXES)}") from err
    return pixels.reshape(size, size, channels).transpose(2, 0, 1)


def make(cfg: Config, seed: int, source):
    from pipelines.data import Dataset

    files = user_files(cfg.files, f"{KEY}.files", SUFFIXES)
    root = files[0].parents[1] if len(files[0].parents) > 1 else files[0].parent
    names = sorted({path.parent.name for path in files})
    if len(names) < 2 or any(path.parent.parent != root for path in files):
        raise ConfigError(f"{KEY}.files={cfg.files!r}: images go in one sub-folder per class "
                          f"(<folder>/<class>/<image>); found classes {names}")
    fit_head(names, source, f"{KEY}.files={cfg.files!r} (a class per sub-folder)")
    size, mean, std = preprocessing(cfg, source)
    chosen = {"finetune_train": [], "finetune_test": []}
    for label, name in enumerate(names):
        mine = [path for path in files if path.parent.name == name]
        train, test = held_out(len(mine), cfg.held_out, seed + label, "images",
                               f"{KEY}.files ({name})")
        chosen["finetune_train"] += [(mine[i], label) for i in train]
        chosen["finetune_test"] += [(mine[i], label) for i in test]
    arrays = {}
    for split, items in chosen.items():
        x = np.stack([load(path, size, cfg.channels) for path, _ in items])
        arrays |= {f"{split}_x": (x - mean) / std,
                   f"{split}_y": np.array([label for _, label in items], np.int64)}
    print(f"{KEY}: classes {names}", flush=True)
    return Dataset(arrays, None, files, names)
