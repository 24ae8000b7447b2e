"""ExecuTorch training of the scheme's parameters (whole tensors; LoRA adapters and all), the
rest frozen: the same sparse update as PyTorch's frozen peer
(pipelines/peers/executorch_training.py)."""
from __future__ import annotations

from pipelines.peers.executorch_training import IMPORTS, cannot_time, et_step, first_losses

WORK = "pruned"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return et_step(spec, signature, batch, frozen=True)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=True)
