"""ExecuTorch training with full backpropagation: every parameter of the model trained by a
program its runtime runs (pipelines/peers/executorch_training.py)."""
from __future__ import annotations

from pipelines.peers.executorch_training import IMPORTS, cannot_time, et_step, first_losses

WORK = "full"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return et_step(spec, signature, batch, frozen=False)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=False)
