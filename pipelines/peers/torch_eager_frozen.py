"""PyTorch eager with the scheme's frozen parameters frozen (requires_grad off), LoRA adapters
and all: what a PyTorch user writes for the same sparse update (channel-sparse updates step
whole gradients, as PyTorch computes them)."""
from __future__ import annotations

from pipelines.peers.pytorch import torch_step

WORK = "pruned"


def make_step(spec, signature, batch):
    return torch_step(spec, signature, batch, frozen=True)
