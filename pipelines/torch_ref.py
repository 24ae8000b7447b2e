"""The PyTorch side of every comparison: the same update the compiled step performs."""
from __future__ import annotations

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)


def make_optimizer(model: torch.nn.Module, cfg: dict, trainable: list[str] | None = None):
    """The torch.optim optimizer ``cfg`` describes (name sgd, adam or adamw, as in
    conf/optimizer) over ``trainable`` parameter names (all when None); the rest are frozen."""
    named = dict(model.named_parameters())
    names = list(named) if trainable is None else trainable
    for name, param in named.items():
        param.requires_grad_(name in names)
    params = [named[n] for n in names]
    kind = cfg.get("name", "sgd")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=float(cfg["lr"]),
                               momentum=float(cfg.get("momentum", 0.0)),
                               weight_decay=float(cfg.get("weight_decay", 0.0)),
                               nesterov=bool(cfg.get("nesterov", False)))
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return adam(params, lr=float(cfg["lr"]), betas=tuple(cfg.get("betas", (0.9, 0.999))),
                eps=float(cfg.get("eps", 1e-8)), weight_decay=float(cfg.get("weight_decay", 0.0)))


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
