"""TFLite (LiteRT) training the scheme's parameters (whole tensors), the rest frozen: the
converted model's ``train`` signature computes gradients of the trained variables only
(pipelines/peers/tflite_training.py)."""
from __future__ import annotations

from pipelines.peers.tflite_training import IMPORTS, cannot_time, first_losses, tflite_step

WORK = "pruned"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return tflite_step(spec, signature, batch, frozen=True)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=True)
