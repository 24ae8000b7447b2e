"""TensorFlow with full backpropagation: every parameter of the model trained by a
``tf.function`` step (pipelines/peers/tensorflow_step.py)."""
from __future__ import annotations

from pipelines.peers.tensorflow_step import IMPORTS, cannot_time, first_losses, tf_step

WORK = "full"
__all__ = ["IMPORTS", "WORK", "cannot_time", "make_step", "check_losses"]


def make_step(spec, signature, batch):
    return tf_step(spec, signature, batch, frozen=False)


def check_losses(spec, signature, batch, steps: int):
    return first_losses(spec, signature, batch, steps, frozen=False)
