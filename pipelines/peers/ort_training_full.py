"""ONNX Runtime training with full backpropagation: every parameter of the plain model trained
(pipelines/peers/onnxruntime_training.py)."""
from __future__ import annotations

from pipelines.peers.onnxruntime_training import IMPORTS, cannot_time, first_losses, ort_step

WORK = "full"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, compiled, batch):
    return ort_step(spec, compiled, batch, frozen=False)


def check_losses(spec, compiled, batch, steps: int):
    return first_losses(spec, compiled, batch, steps, frozen=False)
