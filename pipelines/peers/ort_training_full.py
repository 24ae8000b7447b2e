"""ONNX Runtime training with full backpropagation: every parameter of the plain model trained
(pipelines/peers/onnxruntime_training.py)."""
from __future__ import annotations

from pipelines.peers.onnxruntime_training import IMPORTS, cannot_time, first_losses, ort_step

WORK = "full"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return ort_step(spec, signature, batch, frozen=False)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=False)
