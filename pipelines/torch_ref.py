"""The PyTorch side of every comparison: the same update the compiled step performs."""
from __future__ import annotations

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def make_optimizer(model: torch.nn.Module, cfg: dict, trainable=None):
    """The torch.optim optimizer ``cfg`` describes (name sgd, adam or adamw, as in
    conf/optimizer) over the ``trainable`` parameters (all when None); the rest are frozen.

    ``trainable`` is a list of parameter names, or a scheme's selection (stages/prune/scheme.py:
    name -> None or {"axis", "index"}); channel-selected parameters are stepped by
    ``ChannelSparse``."""
    named = dict(model.named_parameters())
    selection = dict.fromkeys(named if trainable is None else trainable)
    if isinstance(trainable, dict):
        selection.update(trainable)
    for name, param in named.items():
        param.requires_grad_(name in selection)
    if any(selection.values()):
        return ChannelSparse(named, selection, lambda params: _torch_optimizer(params, cfg))
    return _torch_optimizer([named[n] for n in selection], cfg)


def _torch_optimizer(params: list, cfg: dict):
    # Read from the config here, not from stages/autodiff/optimizers.py: the reference must not
    # share the compiled side's reading of it, or a misread setting would match on both sides.
    kind = cfg.get("name", "sgd")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=float(cfg["lr"]),
                               momentum=float(cfg.get("momentum", 0.0)),
                               weight_decay=float(cfg.get("weight_decay", 0.0)),
                               nesterov=bool(cfg.get("nesterov", False)))
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return adam(params, lr=float(cfg["lr"]), betas=tuple(cfg.get("betas", (0.9, 0.999))),
                eps=float(cfg.get("eps", 1e-8)), weight_decay=float(cfg.get("weight_decay", 0.0)))


class ChannelSparse:
    """PyTorch's way to a channel-sparse update: backward computes every selected parameter's
    full gradient; the optimizer then steps only the selected channels. Each channel-selected
    parameter is stepped through a slice-shaped copy (so its optimizer state is slice-shaped,
    as in the compiled step) that is written back into its channels."""

    def __init__(self, named: dict, selection: dict, make):
        """``named``: the model's parameters by name; ``selection``: name -> None or
        {"axis", "index"}; ``make``: parameters -> the torch.optim optimizer to step them."""
        self.sliced = {}  # name -> (parameter, axis, index, slice-shaped copy)
        stepped = []
        for name, choice in selection.items():
            param = named[name]
            if choice is None:
                stepped.append(param)
                continue
            index = torch.tensor(choice["index"])
            copy = torch.nn.Parameter(param.detach().index_select(choice["axis"], index))
            self.sliced[name] = (param, choice["axis"], index, copy)
            stepped.append(copy)
        self.optimizer = make(stepped)

    @property
    def state(self):
        return self.optimizer.state

    def slice_of(self, name: str) -> torch.nn.Parameter:
        """The slice-shaped copy a channel-selected parameter is stepped through."""
        return self.sliced[name][3]

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

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


def train_step(model: torch.nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        logits = model(torch.from_numpy(x[i:i + batch]))
        correct += int((logits.argmax(1).numpy() == y[i:i + batch]).sum())
    model.train(was_training)
    return correct / max(1, len(x))


def batches(n: int, batch: int, seed: int, epoch: int):
    """Index batches of one epoch, shuffled reproducibly; the last partial batch is dropped
    because the compiled step has a static batch size."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for i in range(0, n - batch + 1, batch):
        yield order[i:i + batch]
