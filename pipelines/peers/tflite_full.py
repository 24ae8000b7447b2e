"""TFLite (LiteRT) with full backpropagation: every parameter of the model trained by the
converted model's ``train`` signature (pipelines/peers/tflite_training.py)."""
from __future__ import annotations

from pipelines.peers.tflite_training import IMPORTS, cannot_time, first_losses, tflite_step

WORK = "full"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return tflite_step(spec, signature, batch, frozen=False)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=False)
