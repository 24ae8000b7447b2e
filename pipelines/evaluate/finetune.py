"""Fine-tuning with the compiled step on the model's data, PyTorch performing the same update
beside it: the same initial state, optimizer, batches and order (models/pytorch.py).

The first steps' losses must agree to ``LOSS_RTOL`` or evaluation fails: a wrong build stops
here. Later ones drift apart by float rounding and are reported, not checked. What comes back:
per step the two losses, per evaluation the two held-out scores (a classifier's accuracy, a
language model's loss), and the fine-tuned weights under the source's own names (for a LoRA
scheme also its export, reloaded and checked to score what the compiled step scored).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipelines.data import split
from pipelines.evaluate.checkpoints import Position, restore, save
from pipelines.frontends.base import Finetune
from pipelines.frontends.twin import step_batch, torch_twin
from pipelines.models.pytorch import (accumulated_step, batches, lr_scales_of, make_optimizer,
                                      one_thread, score, selection_of)
from pipelines.models.torch_lora import adapter_state, merged_state
from pipelines.progress import progress, throughput_unit
from pipelines.runtime.step import CompiledStep
from pipelines.schema import ConfigError

CHECKED_STEPS, LOSS_RTOL = 2, 1e-4
# What held-out examples are scored by, per task (models/pytorch.py: score).
METRIC = {"classification": "accuracy", "causal_lm": "held_out_loss",
          "masked_lm": "held_out_loss", "regression": "held_out_loss"}


@dataclass
class Finetuned:
    metrics: dict
    losses: list[dict]  # per step: compiled and pytorch loss
    # per evaluation (each epoch's end, 0 before, and every finetune.eval_every steps): the
    # held-out score of each side (METRIC: accuracy, or the held-out loss)
    evaluations: list[dict]
    step: CompiledStep
    weights: dict[str, torch.Tensor]  # the compiled step's, by the source's names
    # its optimizer state as a torch.optim state dict, to go on training in PyTorch
    # (CompiledStep.torch_optimizer: a channel-sparse step's is ChannelSparse's, slice-shaped)
    optimizer_state: dict
    export: tuple[str, dict] | None  # a LoRA scheme's export: (file name, tensors)

    @property
    def plain_weights(self) -> dict[str, torch.Tensor]:
        """The fine-tuned model without adapters (a LoRA scheme's merged in)."""
        lora = self.step.signature.get("lora")
        if lora is None:
            return self.weights
        if self.export[0] == "merged.safetensors":
            return self.export[1]
        return merged_state(self.weights, lora["scale"])


def learning_rate(lr: float, step: int, total: int, schedule: str, warmup: int) -> float:
    """The learning rate of step ``step`` (from 0) of ``total``: ``lr``, or with ``schedule``
    cosine, transformers' cosine schedule with warm-up: ``lr * step / warmup`` for the first
    ``warmup`` steps, then ``lr * (1 + cos(pi * progress)) / 2`` down to 0 at the last."""
    if schedule == "constant":
        return lr
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizer, lr: float) -> None:
    """A torch.optim optimizer's (or ChannelSparse's) learning rate, for its next steps: each
    param group's times its scale (models/pytorch.py: param_groups)."""
    for group in getattr(optimizer, "optimizer", optimizer).param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@one_thread()  # PyTorch's accuracies then do not depend on the machine's core count
def finetune(model, build, initial: dict, optimizer, data: dict, epochs: int, seed: int,
             lora=None, name: str = "case", checkpoints: Path | None = None,
             every: int = 50) -> Finetuned:
    """Fine-tune the step built in ``build`` from ``initial`` (values by Relax name) for
    ``epochs`` (or the model's ``finetune.max_steps`` steps) on ``data``'s finetune split,
    PyTorch beside it, both at the learning rate the model's ``finetune.lr_schedule`` gives
    each step; ``lora``: the scheme's LoRA section, for its export. With ``checkpoints``, the
    run is saved there every ``every`` steps and at each epoch's end, and goes on from the last
    checkpoint there, if any (checkpoints.py)."""
    compiled = CompiledStep(build, initial)
    signature = compiled.signature
    reference = torch_twin(model, signature, initial)
    evaluator = torch_twin(model, signature, initial)  # holds the compiled step's weights
    update = make_optimizer(reference, optimizer, selection_of(signature),
                            lr_scales_of(signature))
    inputs = signature["data"][:-1]  # the step's inputs by name (the last is the labels)
    xs, y = split(data, "finetune_train", inputs)
    test_xs, test_y = split(data, "finetune_test", inputs)
    batch, accumulate = model.batch_size, optimizer.gradient_accumulation_steps
    if len(y) < batch * accumulate:
        raise ConfigError(f"params.yaml: models.<model>.batch_size={batch} (times "
                          f"gradient_accumulation_steps={accumulate}): the fine-tuning split has "
                          f"{len(y)} training examples, fewer than one step takes; lower them, "
                          "or give the data more examples")
    task = signature["task"]
    tuning = model.finetune or Finetune(epochs=epochs)  # a model without one: the defaults

    def evaluation(epoch: int, step: int) -> dict:
        """Both sides scored on the held-out split (``score``: accuracy, or loss)."""
        return {"epoch": epoch, "step": step, "metric": METRIC[task],
                "compiled": score(compiled.load_into(evaluator), test_xs, test_y, task),
                "pytorch": score(reference, test_xs, test_y, task)}

    at = checkpoints and restore(checkpoints, compiled, reference, update)
    if at:
        print(f"{name}: going on from step {len(at.losses)} (epoch {at.epoch + 1}, its "
              f"step {at.next + 1}), the checkpoint in {checkpoints}", flush=True)
    else:
        at = Position(0, 0, [], [evaluation(0, 0)])
    losses, curve = at.losses, at.evaluations
    per_epoch = len(y) // (batch * accumulate)  # optimizer steps
    if tuning.max_steps:  # a step count instead: the epochs it takes, the last one cut
        epochs = math.ceil(tuning.max_steps / per_epoch)
    total = min(epochs * per_epoch, tuning.max_steps or epochs * per_epoch)
    unit, scale = throughput_unit(xs[0], batch * accumulate)
    for epoch in range(at.epoch, epochs):
        micro = list(batches(len(y), batch, seed, epoch))  # each step: accumulate of them
        order = [micro[j * accumulate:(j + 1) * accumulate]
                 for j in range(per_epoch)][: total - epoch * per_epoch]
        first = len(losses) - (at.next if epoch == at.epoch else 0)
        for i in progress(range(at.next if epoch == at.epoch else 0, len(order)),
                          f"{name}: fine-tuning epoch {epoch + 1}/{epochs}", unit=unit,
                          scale=scale):
            steps = [step_batch(signature, *(a[rows] for a in xs), y[rows]) for rows in order[i]]
            lr = learning_rate(optimizer.lr, len(losses), total, tuning.lr_schedule,
                               tuning.warmup_steps)
            compiled.set_lr(lr)
            set_learning_rate(update, lr)
            # a step's loss: the mean of its batches' (transformers' logged loss)
            losses.append({"step": len(losses) + 1, "lr": lr,
                           "compiled": float(np.mean([compiled.step(*b) for b in steps])),
                           "pytorch": float(np.mean(accumulated_step(reference, update, steps,
                                                                     task)))})
            if tuning.eval_every and len(losses) % tuning.eval_every == 0 and i + 1 < len(order):
                curve.append(evaluation(epoch + (i + 1) / per_epoch, len(losses)))
            if len(losses) == CHECKED_STEPS:
                check_first_losses(name, *([r[side] for r in losses]
                                           for side in ("compiled", "pytorch")))
            if checkpoints and len(losses) % every == 0 and i + 1 < len(order):
                save(checkpoints, Position(epoch, i + 1, losses, curve), compiled, reference,
                     update)
        curve.append(evaluation(epoch + len(order) / per_epoch, len(losses)))
        if checkpoints:
            save(checkpoints, Position(epoch + 1, 0, losses, curve), compiled, reference, update)
        last = losses[first:]
        print(f"{name} epoch {epoch + 1}: loss compiled "
              f"{np.mean([r['compiled'] for r in last]):.4f} pytorch "
              f"{np.mean([r['pytorch'] for r in last]):.4f}; held-out {METRIC[task]} compiled "
              f"{curve[-1]['compiled']:.4f} pytorch {curve[-1]['pytorch']:.4f}", flush=True)
    last = losses[-per_epoch:]
    held_out = {f"{METRIC[task]}_before": curve[0]["compiled"],
                **{f"{METRIC[task]}_{side}": curve[-1][side] for side in ("compiled", "pytorch")}}
    if task in ("causal_lm", "masked_lm"):  # a language model is read by its perplexity
        held_out |= {f"perplexity_{side}": math.exp(held_out[f"{METRIC[task]}_{side}"])
                     for side in ("before", "compiled", "pytorch")}
    final = {side: float(np.mean([r[side] for r in last])) for side in ("compiled", "pytorch")}
    metrics = {
        "steps": len(losses), "epochs": epochs, **held_out,
        **{f"final_epoch_loss_{side}": loss for side, loss in final.items()},
        "max_abs_loss_difference": float(max(abs(r["compiled"] - r["pytorch"])
                                             for r in losses)),
        # the two sides' agreement, which the CI lane gates: it does not move with the
        # machine's instruction set, as the scores themselves do (the pre-trained start does)
        f"{METRIC[task]}_difference": abs(held_out[f"{METRIC[task]}_compiled"]
                                          - held_out[f"{METRIC[task]}_pytorch"]),
        "final_loss_relative_difference": abs(final["compiled"] - final["pytorch"])
                                          / abs(final["pytorch"]),
    }
    weights = compiled.state_dict()
    optimizer_state = compiled.torch_optimizer(compiled.load_into(evaluator)).state_dict()
    export = None
    if lora is not None:
        export = lora_export(weights, lora, selection_of(signature))
        check_export(model, signature, initial, export, test_xs, test_y,
                     curve[-1]["compiled"], name)
    return Finetuned(metrics, losses, curve, compiled, weights, optimizer_state, export)


def over_runs(seeds: list[int], runs: list[dict]) -> dict:
    """Each run's held-out scores and final-epoch losses (``runs``: their metrics, in the order
    of ``seeds``), and per score the runs' mean and standard deviation."""
    summary = {"seeds": seeds}
    for key in (k for k, v in runs[0].items()
                if k.endswith(("_compiled", "_pytorch")) and isinstance(v, float)):
        values = [run[key] for run in runs]
        summary |= {key: values, f"{key}_mean": float(np.mean(values)),
                    f"{key}_std": float(np.std(values))}
    return summary


def check_first_losses(name: str, compiled: list[float], pytorch: list[float]) -> None:
    """The compiled step's first losses are PyTorch's, or the build is wrong: stop."""
    if not np.allclose(compiled, pytorch, rtol=LOSS_RTOL, atol=0):
        raise RuntimeError(f"{name}: the compiled step's first losses {compiled} are not "
                           f"PyTorch's {pytorch} (rtol {LOSS_RTOL})")


def lora_export(weights: dict, lora, trained: dict) -> tuple[str, dict]:
    """A LoRA scheme's fine-tuned model as ``lora.export`` says (models/torch_lora.py): the plain
    model's state with each adapter merged in, or the adapters and other trained tensors."""
    if lora.export == "merged":
        return "merged.safetensors", merged_state(weights, lora.scale)
    return "adapters.safetensors", adapter_state(weights, trained)


def check_export(model, signature: dict, initial: dict, export: tuple[str, dict], xs, y,
                 expected: float, name: str) -> None:
    """The export, loaded as a user would, scores what the compiled step scored: the same
    accuracy but for one example's prediction flipping on rounding, or the same held-out loss
    to 1e-4."""
    filename, tensors = export
    net = torch_twin(model, signature, initial, adapters=filename != "merged.safetensors")
    net.load_state_dict(tensors, strict=False)
    task = signature["task"]
    got = score(net, xs, y, task)
    off = abs(got - expected) > (1.5 / len(y) if task == "classification"
                                 else 1e-4 * abs(expected))
    if off:
        raise RuntimeError(f"{name}: its export {filename} scores {got}, the compiled step's "
                           f"weights {expected} (held-out {METRIC[task]})")
