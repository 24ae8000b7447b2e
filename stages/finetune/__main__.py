"""finetune: transfer the pre-trained model to new classes with the compiled step.

The model was pre-trained on ``data.pretrain_classes``; here it learns ``data.finetune_classes``
(real scikit-learn digits) with the host build of the compiled, sparse training step. PyTorch
performs the same update (same scheme, optimizer, batches and order) beside it.
Outputs (artifacts/finetune/): metrics.json, loss.json and accuracy.json (DVC plots), and
weights.pt, the fine-tuned state dict, which loads into the PyTorch model, and optimizer.pt,
the compiled step's optimizer state as a torch.optim state dict over the trainable parameters
(in signature order), so training can go on in PyTorch where it stopped. For a channel-sparse
scheme that state is slice-shaped: it belongs to the optimizer of ``ChannelSparse``
(pipelines/torch_ref.py), which ``CompiledStep.torch_optimizer`` returns.
"""
from __future__ import annotations

import numpy as np
import torch

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import ConfigError, load_params, require, run_stage
from pipelines.models import build_model
from pipelines.progress import progress
from pipelines.step import CompiledStep, load_initial, selection_of
from pipelines.torch_ref import accuracy, batches, make_optimizer, seed_everything, train_step

OUT = ARTIFACTS / "finetune"
BUILD = ARTIFACTS / "build" / "host"
DATA = ARTIFACTS / "data" / "digits.npz"
WEIGHTS = ARTIFACTS / "pretrain" / "weights.pt"
INITIAL = ARTIFACTS / "lower" / "params.npz"


def main() -> None:
    params = load_params()
    model_cfg, opt_cfg = require(params, "model"), require(params, "optimizer")
    epochs, seed = int(require(params, "finetune.epochs")), int(require(params, "seed"))
    if epochs < 1:
        raise ConfigError(f"params.yaml: finetune.epochs={epochs}; allowed: 1 or more")
    seed_everything(seed)
    data = np.load(DATA)
    x, y = data["finetune_train_x"], data["finetune_train_y"]
    test_x, test_y = data["finetune_test_x"], data["finetune_test_y"]
    batch = int(model_cfg["batch_size"])

    compiled = CompiledStep(BUILD, load_initial(INITIAL))
    reference = build_model(model_cfg).train()
    reference.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    optimizer = make_optimizer(reference, opt_cfg, selection_of(compiled.signature))
    evaluator = build_model(model_cfg)  # holds the compiled step's weights for evaluation
    evaluator.load_state_dict(torch.load(WEIGHTS, weights_only=True))

    def compiled_accuracy() -> float:
        return accuracy(compiled.load_into(evaluator), test_x, test_y)

    start = accuracy(reference, test_x, test_y)
    losses, accuracies, step = [], [{"epoch": 0, "compiled": start, "pytorch": start}], 0
    for epoch in range(epochs):
        first = len(losses)
        for index in progress(list(batches(len(x), batch, seed, epoch)),
                              f"fine-tuning epoch {epoch + 1}/{epochs}"):
            loss_c = compiled.step(x[index], y[index])
            loss_t = train_step(reference, optimizer, torch.from_numpy(x[index]),
                                torch.from_numpy(y[index]))
            step += 1
            losses.append({"step": step, "compiled": loss_c, "pytorch": loss_t})
        accuracies.append({"epoch": epoch + 1, "compiled": compiled_accuracy(),
                           "pytorch": accuracy(reference, test_x, test_y)})
        epoch_losses = losses[first:]
        print(f"epoch {epoch + 1}: loss compiled "
              f"{np.mean([r['compiled'] for r in epoch_losses]):.4f} pytorch "
              f"{np.mean([r['pytorch'] for r in epoch_losses]):.4f}; accuracy "
              f"compiled {accuracies[-1]['compiled']:.3f} pytorch {accuracies[-1]['pytorch']:.3f}",
              flush=True)
    metrics = {
        "scheme": compiled.signature["scheme"],
        "task": "digits: pre-trained on classes "
                f"{params['data']['pretrain_classes']}, fine-tuned on {params['data']['finetune_classes']}",
        "steps": step,
        "accuracy_before": start,
        "accuracy_compiled": accuracies[-1]["compiled"],
        "accuracy_pytorch": accuracies[-1]["pytorch"],
        "final_epoch_loss_compiled": float(np.mean([r["compiled"] for r in epoch_losses])),
        "final_epoch_loss_pytorch": float(np.mean([r["pytorch"] for r in epoch_losses])),
        "max_abs_loss_difference": float(max(abs(r["compiled"] - r["pytorch"]) for r in losses)),
    }
    with atomic_dir(OUT) as tmp:
        write_json_atomic(tmp / "metrics.json", metrics)
        write_json_atomic(tmp / "loss.json", losses)
        write_json_atomic(tmp / "accuracy.json", accuracies)
        torch.save(compiled.load_into(evaluator).state_dict(), tmp / "weights.pt")
        torch.save(compiled.torch_optimizer(evaluator).state_dict(), tmp / "optimizer.pt")
        write_manifest(tmp, "finetune", {"build": BUILD, "data": DATA, "weights": WEIGHTS},
                       {"finetune": params["finetune"], "optimizer": opt_cfg})
    print(metrics)


if __name__ == "__main__":
    run_stage(main)
