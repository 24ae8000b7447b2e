"""PyTorch eager with full backpropagation: every parameter trained, whatever the scheme."""
from __future__ import annotations

from pipelines.peers.pytorch import torch_step

WORK = "full"


def make_step(spec, signature, batch):
    return torch_step(spec, signature, batch, frozen=False)
