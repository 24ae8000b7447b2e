"""The weights a model's cases start from: what its source holds, or, with a ``pretrain``
section, a PyTorch model pre-trained here on the data's pretrain split. That stands in for a
downloaded checkpoint; as a transfer from one does, it keeps the trained backbone and starts the
modules ``pretrain.keep_initial`` names (a new head) from their seeded initial values.

Written as safetensors under the source's own names (``weights.safetensors``).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pipelines.data import split
from pipelines.frontends import load_module
from pipelines.models.pytorch import (batches, make_optimizer, one_thread, score,
                                      seed_everything, train_step)
from pipelines.patterns import module_matcher
from pipelines.progress import progress, throughput_unit

FILE = "weights.safetensors"


@one_thread()
def initial_weights(model, data: dict | None, seed: int) -> tuple[dict, dict]:
    """(state dict, metrics) of a torch model: seeded, pre-trained if configured (on one
    thread: the same weights on any machine's core count)."""
    seed_everything(seed)
    module, example = load_module(model)
    if model.pretrain is None:
        return module.state_dict(), {}
    cfg = model.pretrain
    keep = [module_matcher(p) for p in cfg.keep_initial]
    initial = {k: v.clone() for k, v in module.state_dict().items()
               if any(match(k.rsplit(".", 1)[0]) for match in keep)}
    inputs = list(example)  # forward's names, bound to the data's columns
    xs, y = split(data, "pretrain_train", inputs)
    optimizer = make_optimizer(module.train(), cfg)
    losses = []
    unit, scale = throughput_unit(xs[0], cfg.batch_size)
    for epoch in range(cfg.epochs):
        order = list(batches(len(y), cfg.batch_size, seed, epoch))
        losses = [train_step(module, optimizer, *(a[i] for a in xs), y[i], task=model.task)
                  for i in progress(order, f"pretrain epoch {epoch + 1}/{cfg.epochs}", unit=unit,
                                    scale=scale)]
        print(f"pretrain epoch {epoch}: loss {np.mean(losses):.4f}", flush=True)
    test_xs, test_y = split(data, "pretrain_test", inputs)
    held_out = score(module, test_xs, test_y, model.task)  # accuracy, or the held-out loss
    metrics = {"pretrain_final_loss": float(np.mean(losses))}
    if model.task == "classification":
        metrics["pretrain_test_accuracy"] = held_out
    else:
        metrics["pretrain_test_loss"] = held_out
    if model.task in ("causal_lm", "masked_lm"):  # a language model is read by its perplexity
        metrics["pretrain_test_perplexity"] = math.exp(held_out)
    return {**module.state_dict(), **initial}, metrics


def save_weights(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    # contiguous copies: safetensors refuses tensors that share storage (tied weights)
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))


def save_optimizer_state(state: dict, path: Path) -> None:
    """A torch.optim state dict as safetensors, never a pickle: each tensor of ``state``
    under ``<param index>.<key>``, the rest (numbers, ``param_groups``) as JSON metadata."""
    import json

    from safetensors.torch import save_file

    tensors, numbers = {}, {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().clone()
            else:
                numbers[f"{index}.{key}"] = value
    save_file(tensors, str(path), metadata={
        "param_groups": json.dumps(state["param_groups"]), "numbers": json.dumps(numbers)})


def load_optimizer_state(path: Path) -> dict:
    """``save_optimizer_state``'s file as the state dict ``optimizer.load_state_dict`` takes."""
    import json

    from safetensors import safe_open

    from pipelines.io import verified

    state: dict = {}
    with safe_open(str(verified(path)), framework="pt") as handle:
        meta = handle.metadata()
        for name in handle.keys():
            index, key = name.split(".", 1)
            state.setdefault(int(index), {})[key] = handle.get_tensor(name)
    for name, value in json.loads(meta["numbers"]).items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    # JSON has no tuples: torch.optim keeps its pairs (Adam's betas) as tuples
    groups = [{key: tuple(value) if isinstance(value, list) and key != "params" else value
               for key, value in group.items()} for group in json.loads(meta["param_groups"])]
    return {"state": state, "param_groups": groups}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from pipelines.io import verified

    return load_file(str(verified(path)))
