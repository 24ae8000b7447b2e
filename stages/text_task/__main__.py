"""text_task: fine-tune the pretrained MiniLM on a sentence task, per scheme, compiled and PyTorch.

Usage: python -m stages.text_task
The task (stages/text_task/data.py, synthetic, seeded): say whether a review sentence is
positive, with negation and "but" clauses; scored by accuracy on test sentences whose sentiment
words and things no training sentence has. The model (``text_task.model``, a conf/model entry
of arch minilm) starts from its pretrained encoder and a seeded head. Each scheme of
``text_task.schemes`` (conf/sparse: full BP, the paper's transformer scheme, LoRA) is built
here for the host profile, as the workloads stage builds it, and fine-tuned for
``text_task.epochs`` with the ``text_task.optimizer`` (a conf/optimizer entry) at the scheme's
learning rate (``text_task.lr``); PyTorch performs
the same updates beside it (same initial weights, batches and order).

Outputs (artifacts/text_task/):
  metrics.json     per scheme: accuracy and loss, compiled and PyTorch; what trained
  loss.json        per step and scheme, the compiled and PyTorch losses (DVC plots)
  exports/<scheme>/  for a LoRA scheme, its fine-tuned export (lora.export): adapter.pt (the
                   adapters and the other trained tensors, e.g. the head, to add to the
                   pretrained model) or weights.pt (adapters merged: the plain model's state
                   dict). The stage reloads each export and checks it scores what the compiled
                   step scored.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic
from pipelines.config import (ConfigError, load_conf_entry, load_params, require,
                              resolved_profile, run_stage, tvm_target)
from pipelines.lora import adapted, adapter_state, check_lora, merged_state
from pipelines.models import build_model
from pipelines.progress import progress
from pipelines.step import CompiledStep, initial_from, save_step, selection_of
from pipelines.torch_ref import accuracy, batches, make_optimizer, train_step
from stages.optimize.passes import optimize
from stages.prune.show import scheme_step
from stages.text_task.data import load_vocab, sentences, tokenize

OUT = ARTIFACTS / "text_task"
# The first steps' losses must agree with PyTorch's to this tolerance (a wrong build fails
# here); later ones drift apart by float rounding and are reported, not checked.
CHECKED_STEPS, LOSS_RTOL = 2, 1e-4
TASK = ("sentiment of synthetic review sentences (negation, 'but' clauses); test sentences use "
        "sentiment words and things no training sentence has")


def load_task(params: dict) -> tuple[dict, list[dict], dict]:
    """The model, schemes and per scheme its optimizer (``text_task.optimizer`` with the
    scheme's ``text_task.lr``), each checked before any work."""
    task = require(params, "text_task")
    model = load_conf_entry("model", str(require(params, "text_task.model")), "text_task.model")
    if model.get("arch") != "minilm":
        raise ConfigError(f"params.yaml: text_task.model={model.get('name')!r} is a "
                          f"{model.get('arch')} model; allowed: an encoder with a classification "
                          "head (arch minilm), e.g. minilm")
    schemes = require(params, "text_task.schemes")
    if not isinstance(schemes, list) or not schemes:
        raise ConfigError("params.yaml: text_task.schemes must list conf/sparse schemes, e.g. "
                          "[full, minilm_paper, minilm_lora]")
    schemes = [load_conf_entry("sparse", str(s), "text_task.schemes") for s in schemes]
    for scheme in schemes:
        if scheme.get("lora") is not None:
            check_lora(scheme["lora"], f"conf/sparse/{scheme['name']}.yaml: lora")
    optimizer = load_conf_entry("optimizer", str(require(params, "text_task.optimizer")),
                                "text_task.optimizer")
    # Per scheme: fewer trainable parameters take a larger step (LoRA's adapters start at
    # zero), and full BP at a large one forgets what the pretrained encoder knew.
    rates = task.get("lr")
    names = [s["name"] for s in schemes]
    if not isinstance(rates, dict) or set(names) - set(rates):
        raise ConfigError(f"params.yaml: text_task.lr={rates!r}; allowed: a learning rate per "
                          f"scheme, for each of {names}")
    optimizers = {}
    for name in names:
        if not isinstance(rates[name], (int, float)) or rates[name] <= 0:
            raise ConfigError(f"params.yaml: text_task.lr.{name}={rates[name]!r}; allowed: a "
                              "number > 0")
        optimizers[name] = dict(optimizer, lr=float(rates[name]))
    for key in ("epochs", "train_sentences", "test_sentences"):
        value = task.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"params.yaml: text_task.{key}={value!r}; allowed: an integer "
                              ">= 1")
    if task["train_sentences"] < int(model["batch_size"]):
        raise ConfigError(f"params.yaml: text_task.train_sentences={task['train_sentences']} is "
                          f"less than one batch (model.batch_size={model['batch_size']})")
    return model, schemes, optimizers


def main() -> None:
    params = load_params()
    model, schemes, optimizers = load_task(params)
    task, seed = params["text_task"], int(require(params, "seed"))
    target = tvm_target(resolved_profile("host"))
    vocab, seq_len = load_vocab(), int(model["seq_len"])
    train_text, train_y = sentences("train", task["train_sentences"], seed)
    test_text, test_y = sentences("test", task["test_sentences"], seed)
    train_x, test_x = tokenize(train_text, seq_len, vocab), tokenize(test_text, seq_len, vocab)

    torch.manual_seed(seed)
    base = build_model(model).train()  # the pretrained encoder and a seeded head
    accuracy_before = accuracy(base, test_x, test_y)

    def fresh(lora: dict | None) -> torch.nn.Module:
        """The starting model of a scheme: its adapters, if any, added (seeded)."""
        return adapted(base, lora, seed)

    full_steps, rows, curves, exports = {}, {}, {}, {}
    scratch = Path(tempfile.mkdtemp(prefix="pock-text-task-"))
    try:
        for scheme in schemes:
            lora, optimizer = scheme.get("lora"), optimizers[scheme["name"]]
            # The learning rate is a constant of the step: one full step per rate.
            step, signature, summary = scheme_step(model, optimizer, scheme, seed, full_steps)
            directory = scratch / scheme["name"]
            directory.mkdir()
            save_step(optimize(step, signature, reorder=True), signature, target, directory,
                      measured_backends=True)

            reference = fresh(lora)
            compiled, losses = fine_tune(directory, reference, optimizer, signature, train_x,
                                         train_y, task["epochs"], int(model["batch_size"]),
                                         seed, scheme["name"])
            tuned = compiled.load_into(fresh(lora))
            rows[scheme["name"]] = row(scheme, summary, losses, accuracy(tuned, test_x, test_y),
                                       accuracy(reference, test_x, test_y),
                                       len(train_x) // int(model["batch_size"]))
            curves[scheme["name"]] = losses
            if lora:
                exports[scheme["name"]] = export(tuned, lora, selection_of(signature))
                check_export(scheme["name"], exports[scheme["name"]], fresh, test_x, test_y,
                             rows[scheme["name"]]["accuracy_compiled"])
            done = rows[scheme["name"]]
            print(f"{scheme['name']}: accuracy compiled {done['accuracy_compiled']:.3f} pytorch "
                  f"{done['accuracy_pytorch']:.3f} (before {accuracy_before:.3f}); last epoch "
                  f"loss compiled {done['final_epoch_loss_compiled']:.4f} pytorch "
                  f"{done['final_epoch_loss_pytorch']:.4f}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    metrics = {"model": model["name"], "task": TASK,
               "data": "synthetic: generated by code, seeded (stages/text_task/data.py)",
               "train_sentences": len(train_x), "test_sentences": len(test_x),
               "epochs": task["epochs"], "optimizers": optimizers,
               "accuracy_before": accuracy_before, "schemes": rows}
    steps = [{"step": i + 1, **{f"{name}_{side}": losses[i][j]
                                for name, losses in curves.items()
                                for j, side in enumerate(("compiled", "pytorch"))}}
             for i in range(max(len(c) for c in curves.values()))]
    with atomic_dir(OUT) as tmp:
        write_json_atomic(tmp / "metrics.json", metrics)
        write_json_atomic(tmp / "loss.json", steps)
        (tmp / "exports").mkdir()
        for name, (filename, payload) in exports.items():
            (tmp / "exports" / name).mkdir()
            torch.save(payload, tmp / "exports" / name / filename)


def fine_tune(directory: Path, reference: torch.nn.Module, optimizer: dict, signature: dict,
              x_all: np.ndarray, y_all: np.ndarray, epochs: int, batch: int, seed: int,
              name: str) -> tuple[CompiledStep, list[tuple[float, float]]]:
    """The compiled step in ``directory`` and PyTorch (``reference``, updated in place) on the
    same batches from the same weights; per step, (compiled loss, PyTorch loss)."""
    compiled = CompiledStep(directory, initial_from(reference, signature))
    update = make_optimizer(reference, optimizer, selection_of(signature))
    losses = []
    for epoch in range(epochs):
        for index in progress(list(batches(len(x_all), batch, seed, epoch)),
                              f"text task {name} epoch {epoch + 1}"):
            x, y = x_all[index], y_all[index]
            losses.append((compiled.step(x, y),
                           train_step(reference, update, torch.from_numpy(x),
                                      torch.from_numpy(y))))
            if len(losses) == CHECKED_STEPS:
                check_first_losses(name, losses)
    return compiled, losses


def check_first_losses(name: str, losses: list[tuple[float, float]]) -> None:
    compiled, pytorch = zip(*losses)
    if not np.allclose(compiled, pytorch, rtol=LOSS_RTOL, atol=0):
        raise SystemExit(f"error: text task {name}: the compiled step's first losses {compiled} "
                         f"are not PyTorch's {pytorch} (rtol {LOSS_RTOL})")


def row(scheme: dict, summary: dict, losses: list, accuracy_compiled: float,
        accuracy_pytorch: float, steps_per_epoch: int) -> dict:
    last = np.array(losses[-steps_per_epoch:])
    return {"accuracy_compiled": accuracy_compiled, "accuracy_pytorch": accuracy_pytorch,
            "final_epoch_loss_compiled": float(last[:, 0].mean()),
            "final_epoch_loss_pytorch": float(last[:, 1].mean()),
            "max_abs_loss_difference": float(np.abs(np.diff(np.array(losses), axis=1)).max()),
            "trainable_elements": summary["pruned"]["trainable_elements"],
            "trainable_fraction": (summary["pruned"]["trainable_elements"]
                                   / summary["full"]["trainable_elements"]),
            "steps": len(losses), **({"lora": scheme["lora"]} if scheme.get("lora") else {})}


def export(tuned: torch.nn.Module, lora: dict, trained: dict) -> tuple[str, dict]:
    """A LoRA scheme's fine-tuned model as ``lora.export`` says (pipelines/lora.py)."""
    lora = check_lora(lora)
    state = tuned.state_dict()
    if lora["export"] == "merged":
        return "weights.pt", merged_state(state, lora)
    return "adapter.pt", {"lora": lora, "state": adapter_state(state, trained)}


def check_export(name: str, exported: tuple[str, dict], fresh, x, y, expected: float) -> None:
    """The export, loaded as a user would, scores what the compiled step scored."""
    filename, payload = exported
    if filename == "weights.pt":
        net = fresh(None)
        net.load_state_dict(payload)
    else:
        net = fresh(payload["lora"])
        net.load_state_dict(payload["state"], strict=False)
    score = accuracy(net, x, y)
    if abs(score - expected) > 1.5 / len(x):  # one sentence's prediction may flip on rounding
        raise SystemExit(f"error: text task {name}: its export {filename} scores {score}, the "
                         f"compiled step's weights {expected}")


if __name__ == "__main__":
    run_stage(main)
