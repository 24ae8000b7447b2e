"""The PyTorch side of every comparison: the same update the compiled step performs, on the same
module, batches and order.

A batch is a tuple of arrays: the model's inputs, in the step's order, then the labels.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from pipelines.tasks import IGNORE_INDEX


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


@contextmanager
def one_thread():
    """PyTorch on one CPU thread inside: its kernels split reductions by thread count, so the
    rounding, and a training run that amplifies it, depends on the machine's cores otherwise
    (digits MobileNetV2 pre-training at lr 0.05, seed 0: final loss 0.44 on 2 threads, 0.077
    on 1). Training here is a reference and a quality figure, not a timing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hold_statistics(module: torch.nn.Module, names) -> torch.nn.Module:
    """The batch norms ``names`` (module paths) of ``module`` in eval mode for good: they
    normalise with their running statistics and leave them unchanged whatever ``train()`` says
    later, as the compiled step's do (transform/freeze_statistics.py)."""
    for name in names:
        norm = module.get_submodule(name)
        norm.train = partial(_in_eval_mode, norm)  # what module.train() calls on each child
        norm.eval()
    return module


def batch_norms(model: torch.nn.Module, training: bool) -> list[str]:
    """The names of ``model``'s batch norms that update their statistics (``training``), or
    of those that normalise with their running ones (held: ``hold_statistics``)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and module.training == training]


def _in_eval_mode(norm: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
    norm.training = False
    return norm


def selection_of(signature: dict) -> dict[str, dict | None]:
    """The scheme's selection a step was built with, under the source's names (training/scheme.py:
    None for a whole parameter, {"axis", "index"} for some channels)."""
    names, channels = signature["source_names"], signature.get("channels", {})
    return {names[p]: channels.get(p) for p in signature["trainable"]}


def lr_scales_of(signature: dict) -> dict[str, float]:
    """The learning-rate scales a step was built with (training/scheme.py: lr_scales), under the
    source's names: its PyTorch twin's param groups (make_optimizer)."""
    return signature.get("lr_scales", {})


def make_optimizer(model: torch.nn.Module, optimizer, trainable=None, lr_scales=None):
    """The torch.optim optimizer ``optimizer`` describes (pipelines/config.py: SGD or Adam) over
    the ``trainable`` parameters (all when None); the rest are frozen.

    ``trainable`` is a list of parameter names, or a scheme's selection (training/scheme.py:
    name -> None or {"axis", "index"}); channel-selected parameters are stepped by
    ``ChannelSparse``. ``lr_scales`` (name -> scale; training/scheme.py: lr_scales) puts
    parameters in param groups of their own at the learning rate times their scale."""
    # a tied parameter (GPT-2's head and embeddings) under each of its names: the compiled
    # step knows it by the one its export kept
    named = dict(model.named_parameters(remove_duplicate=False))
    selection = dict.fromkeys(dict(model.named_parameters()) if trainable is None else trainable)
    if isinstance(trainable, dict):
        selection.update(trainable)
    chosen = {id(named[name]) for name in selection}
    for param in named.values():
        param.requires_grad_(id(param) in chosen)

    def make(params: dict) -> torch.optim.Optimizer:
        return _torch_optimizer(param_groups(params, optimizer.lr, lr_scales), optimizer)

    if any(selection.values()):
        return ChannelSparse(named, selection, make)
    return make({n: named[n] for n in selection})


def grouped(names: list[str], lr_scales: dict | None) -> dict[float, list[str]]:
    """``names`` by learning-rate scale (1 where none is given), each scale's in their order:
    one torch.optim param group each, whose parameters its state dict numbers in this order."""
    groups: dict[float, list[str]] = {}
    for name in names:
        groups.setdefault((lr_scales or {}).get(name, 1.0), []).append(name)
    return groups


def param_groups(params: dict, lr: float, lr_scales: dict | None) -> list:
    """``params`` (name -> tensor, in order) as torch.optim takes them: a list, or with
    learning-rate scales one param group per scale at ``lr`` times it, which keeps its
    ``lr_scale`` for a schedule (evaluate/finetune.py: set_learning_rate)."""
    groups = grouped(list(params), lr_scales)
    if list(groups) == [1.0]:
        return list(params.values())
    return [{"params": [params[n] for n in names], "lr": lr * scale, "lr_scale": scale}
            for scale, names in groups.items()]


def _torch_optimizer(params: list, optimizer):
    # Read from the config here, not from training/optimizers.py: the reference must not share
    # the compiled side's reading of it, or a misread setting would match on both sides.
    if optimizer.kind == "sgd":
        return torch.optim.SGD(params, lr=optimizer.lr, momentum=optimizer.momentum,
                               weight_decay=optimizer.weight_decay, nesterov=optimizer.nesterov)
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[optimizer.kind]
    return adam(params, lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps,
                weight_decay=optimizer.weight_decay)


class ChannelSparse:
    """PyTorch's way to a channel-sparse update: backward computes every selected parameter's
    full gradient; the optimizer then steps only the selected channels. Each channel-selected
    parameter is stepped through a slice-shaped copy (so its optimizer state is slice-shaped,
    as in the compiled step) that is written back into its channels."""

    def __init__(self, named: dict, selection: dict, make):
        """``named``: the model's parameters by name; ``selection``: name -> None or
        {"axis", "index"}; ``make``: parameters by name -> the torch.optim optimizer to step
        them."""
        self.sliced = {}  # name -> (parameter, axis, index, slice-shaped copy)
        stepped = {}
        for name, choice in selection.items():
            param = named[name]
            if choice is None:
                stepped[name] = param
                continue
            index = torch.tensor(choice["index"])
            copy = torch.nn.Parameter(param.detach().index_select(choice["axis"], index))
            self.sliced[name] = (param, choice["axis"], index, copy)
            stepped[name] = copy
        self.optimizer = make(stepped)

    @property
    def state(self):
        return self.optimizer.state

    def slice_of(self, name: str) -> torch.nn.Parameter:
        """The slice-shaped copy a channel-selected parameter is stepped through."""
        return self.sliced[name][3]

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The inner optimizer's state (the slices are taken from the parameters each step)."""
        self.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param, *_ in self.sliced.values():
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param, axis, index, copy in self.sliced.values():
            copy.copy_(param.index_select(axis, index))
            copy.grad = param.grad.index_select(axis, index)
        self.optimizer.step()
        for param, axis, index, copy in self.sliced.values():
            param.index_copy_(axis, index, copy)


def _tensors(batch) -> list[torch.Tensor]:
    return [b if isinstance(b, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(b))
            for b in batch]


def task_loss(task: str, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of a model ``task`` (pipelines/config.py: TASKS), as PyTorch and transformers
    write it; the compiled step's is training/loss.py."""
    cross_entropy = torch.nn.functional.cross_entropy
    if task == "classification":
        return cross_entropy(output, labels, ignore_index=IGNORE_INDEX)
    if task == "causal_lm":  # position t predicts token t+1
        return cross_entropy(output[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                             ignore_index=IGNORE_INDEX)
    if task == "masked_lm":
        return cross_entropy(output.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    if task == "regression":
        return torch.nn.functional.mse_loss(output, labels)
    raise ValueError(f"task {task!r}")


def train_step(model: torch.nn.Module, optimizer, *batch, task: str = "classification") -> float:
    """One step on ``batch`` (the model's inputs, then the labels): the ``task``'s loss, as the
    compiled step's; returns the loss."""
    return accumulated_step(model, optimizer, [batch], task)[0]


def accumulated_step(model: torch.nn.Module, optimizer, batches: list, task: str) -> list[float]:
    """One optimizer step on the gradients of several ``batches`` (each the model's inputs,
    then the labels): each one's loss divided by their number, ``backward`` summing into
    ``.grad``, as gradient accumulation is written in PyTorch; each batch's loss."""
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for batch in batches:
        *inputs, labels = _tensors(batch)
        loss = task_loss(task, model(*inputs), labels)
        (loss / len(batches) if len(batches) > 1 else loss).backward()
        losses.append(loss.item())
    optimizer.step()
    return losses


@torch.no_grad()
def accuracy(model: torch.nn.Module, inputs: list[np.ndarray], labels: np.ndarray,
             batch: int = 256) -> float:
    """The share of examples whose largest logit is their label (the model in eval mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(labels), batch):
        logits = model(*_tensors([x[i:i + batch] for x in inputs]))
        correct += int((logits.argmax(-1).numpy() == labels[i:i + batch]).sum())
    model.train(was_training)
    return correct / max(1, len(labels))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, inputs: list[np.ndarray], labels: np.ndarray,
                  task: str, batch: int = 64) -> float:
    """The ``task``'s loss over held-out examples (the model in eval mode), averaged over every
    label that scores (each token of a language model's), as one batch of them all would be."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(labels), batch):
        output = model(*_tensors([x[i:i + batch] for x in inputs]))
        y = torch.from_numpy(np.ascontiguousarray(labels[i:i + batch]))
        if task == "regression":
            total += float(torch.nn.functional.mse_loss(output, y, reduction="sum"))
            count += y.numel()
            continue
        if task == "causal_lm":  # position t predicts token t+1
            output, y = output[:, :-1], y[:, 1:]
        output = output.reshape(-1, output.shape[-1]) if task != "classification" else output
        y = y.flatten()
        total += float(torch.nn.functional.cross_entropy(output, y, ignore_index=IGNORE_INDEX,
                                                         reduction="sum"))
        count += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(1, count)


def score(model: torch.nn.Module, inputs: list[np.ndarray], labels: np.ndarray,
          task: str) -> float:
    """How well ``model`` does on held-out examples: a classifier's accuracy (higher is
    better), else the task's held-out loss (lower is better; a language model's perplexity is
    its exponential)."""
    if task == "classification":
        return accuracy(model, inputs, labels)
    return held_out_loss(model, inputs, labels, task)


def batches(n: int, batch: int, seed: int, epoch: int):
    """Index batches of one epoch, shuffled reproducibly; the last partial batch is dropped
    because the compiled step has a static batch size."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for i in range(0, n - batch + 1, batch):
        yield order[i:i + batch]
