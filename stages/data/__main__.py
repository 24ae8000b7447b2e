"""data: scikit-learn's digits, split for transfer learning, at the model's input size.

Pre-training sees only ``data.pretrain_classes``; fine-tuning sees ``data.finetune_classes``
(each split into train and test). Images are upsampled (bilinear) from 8x8 to
``model.image_size`` and repeated over ``model.in_channels``. Output: artifacts/data/digits.npz.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

from pipelines.artifacts import ARTIFACTS, atomic_dir, save_arrays, write_manifest
from pipelines.config import ConfigError, load_params, require, run_stage

OUT = ARTIFACTS / "data"


def make_splits(data_cfg: dict, model_cfg: dict, seed: int) -> dict[str, np.ndarray]:
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    size = int(model_cfg["image_size"])
    images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear",
                                             align_corners=False)
    images = ((images - 0.5) / 0.5).repeat(1, int(model_cfg["in_channels"]), 1, 1).numpy()
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    splits = {}
    for part in ("pretrain", "finetune"):
        classes = data_cfg[f"{part}_classes"]
        bad = [c for c in classes if not 0 <= c < int(model_cfg["num_classes"])]
        if bad or not classes:
            raise ConfigError(f"params.yaml: data.{part}_classes={classes} must be a non-empty "
                              f"list of labels in 0..{int(model_cfg['num_classes']) - 1}")
        index = np.flatnonzero(np.isin(labels, classes))
        rng.shuffle(index)
        n_test = int(round(len(index) * float(data_cfg["test_fraction"])))
        for name, idx in (("test", index[:n_test]), ("train", index[n_test:])):
            splits[f"{part}_{name}_x"] = images[idx]
            splits[f"{part}_{name}_y"] = labels[idx]
    return splits


def main() -> None:
    params = load_params()
    data_cfg, model_cfg = require(params, "data"), require(params, "model")
    if model_cfg.get("arch") != "mobilenetv2":  # the digits task feeds image models only
        raise ConfigError(f"params.yaml: model.arch={model_cfg.get('arch')!r}: the data stage "
                          "has only an image task (digits); allowed: ['mobilenetv2']. The "
                          "compiler stages and `pock scheme show` take the text models "
                          "(llama, minilm) already.")
    splits = make_splits(data_cfg, model_cfg, int(require(params, "seed")))
    with atomic_dir(OUT) as tmp:
        save_arrays(tmp / "digits.npz", splits)
        write_manifest(tmp, "data", {}, {"data": data_cfg, "image_size": model_cfg["image_size"]})
    print(" ".join(f"{k}={len(v)}" for k, v in splits.items() if k.endswith("_y")))


if __name__ == "__main__":
    run_stage(main)
