"""pretrain: train the reference model in PyTorch on the pretrain classes.

This stands in for downloading pretrained weights (nothing is downloaded here): the fine-tune
stage then transfers these weights to classes the model has never seen. As a transfer from a
downloaded checkpoint does, it keeps the trained backbone and starts a fresh classifier head:
the one the model was initialised with (seeded), as text_task's MiniLM gets a seeded head.
Output: artifacts/pretrain/weights.pt (state dict: trained backbone, fresh head) and
metrics.json (the trained model's accuracy on the pretrain classes).
"""
from __future__ import annotations

import numpy as np
import torch

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.models import build_model
from pipelines.torch_ref import accuracy, batches, make_optimizer, seed_everything, train_step

OUT = ARTIFACTS / "pretrain"
DATA = ARTIFACTS / "data" / "digits.npz"


def main() -> None:
    params = load_params()
    model_cfg, cfg = require(params, "model"), require(params, "pretrain")
    seed = int(require(params, "seed"))
    seed_everything(seed)
    model = build_model(model_cfg).train()
    data = np.load(DATA)
    x, y = data["pretrain_train_x"], data["pretrain_train_y"]
    # The trained head's rows for the classes it never saw started fine-tuning at a loss near
    # 30, on a path so unstable that rounding alone (PyTorch on 1 thread or 2, another CPU)
    # moved the CI lane's accuracy by 0.1 to 0.2; from a fresh head, near ln(10), by under 0.01.
    fresh_head = {k: v.clone() for k, v in model.state_dict().items()
                  if k.startswith("classifier.")}
    opt = make_optimizer(model, cfg)
    batch = int(cfg["batch_size"])
    for epoch in range(int(cfg["epochs"])):
        losses = [train_step(model, opt, torch.from_numpy(x[i]), torch.from_numpy(y[i]))
                  for i in batches(len(x), batch, seed, epoch)]
        print(f"pretrain epoch {epoch}: loss {np.mean(losses):.4f}", flush=True)
    metrics = {"pretrain_test_accuracy": accuracy(model, data["pretrain_test_x"],
                                                  data["pretrain_test_y"]),
               "pretrain_final_loss": float(np.mean(losses))}
    with atomic_dir(OUT) as tmp:
        torch.save({**model.state_dict(), **fresh_head}, tmp / "weights.pt")
        write_json_atomic(tmp / "metrics.json", metrics)
        write_manifest(tmp, "pretrain", {"data": DATA}, {"model": model_cfg, "pretrain": cfg})
    print(metrics)


if __name__ == "__main__":
    run_stage(main)
