"""``torch.compile`` (Inductor) with full backpropagation: forward and backward compiled, the
update eager."""
from __future__ import annotations

from pipelines.peers.pytorch import torch_step

WORK = "full"


def make_step(spec, signature, batch):
    return torch_step(spec, signature, batch, frozen=False, compile=True)
