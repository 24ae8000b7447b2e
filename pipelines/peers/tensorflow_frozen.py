"""TensorFlow training the scheme's parameters (whole tensors), the rest frozen: gradients of
the trained variables only (pipelines/peers/tensorflow_step.py)."""
from __future__ import annotations

from pipelines.peers.tensorflow_step import IMPORTS, cannot_time, first_losses, tf_step

WORK = "pruned"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return tf_step(spec, signature, batch, frozen=True)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=True)
