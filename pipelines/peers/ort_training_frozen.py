"""ONNX Runtime training of the scheme's parameters (whole tensors; LoRA adapters and all), the
rest frozen: the same sparse update as PyTorch's frozen peer
(pipelines/peers/onnxruntime_training.py)."""
from __future__ import annotations

from pipelines.peers.onnxruntime_training import IMPORTS, cannot_time, first_losses, ort_step

WORK = "pruned"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return ort_step(spec, signature, batch, frozen=True)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=True)
