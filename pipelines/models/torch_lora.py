"""LoRA on the PyTorch side (Hu et al., 2021): the twin of a LoRA case's compiled step, and the
fine-tuned adapters written back as a user would load them.

The compiled step gets its adapters from pipelines/training/lora.py (a pass on the lowered
graph, for any frontend); their names are the projection's module path plus ``.lora_a.weight``
(r x in) and ``.lora_b.weight`` (out x r). Here each such projection, an ``nn.Linear``, becomes
a ``LoRALinear`` in place under the same name, so the twin's state dict has the step's names and
loads the step's initial values.

Export: ``merged`` folds each adapter into its projection (W + scale * B A), giving a state dict
of the model without adapters; ``separate`` keeps the model's own weights and writes the
adapters (and any other trained tensor, such as a new head) beside them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SUFFIXES = (".lora_a.weight", ".lora_b.weight")


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * (x A^T) B^T, with W and b the projection's own."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        nn.Module.__init__(self)  # not nn.Linear's: that would draw a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # skip_init: no values drawn (nor the global generator moved); they are loaded after
        self.lora_a = nn.utils.skip_init(nn.Linear, base.in_features, rank, bias=False)
        self.lora_b = nn.utils.skip_init(nn.Linear, rank, base.out_features, bias=False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_b(self.lora_a(x)) * self.scale


def adapted_modules(state: dict) -> list[str]:
    """The module paths that carry an adapter in a state dict (or a list of names)."""
    return [name.removesuffix(SUFFIXES[0]) for name in state if name.endswith(SUFFIXES[0])]


def add_adapters(model: nn.Module, modules: list[str], rank: int, scale: float) -> nn.Module:
    """Put an adapter beside each linear projection in ``modules`` (paths), in place; their
    values are loaded afterwards (the step's initial state)."""
    for path in modules:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        base = getattr(parent, child)
        if type(base) is not nn.Linear:
            raise TypeError(f"{path}: LoRA adapts nn.Linear layers; this is {type(base).__name__}")
        setattr(parent, child, LoRALinear(base, rank, scale))
    return model


def merged_state(state: dict, scale: float) -> dict:
    """A state dict of the model with adapters -> one of the model without: W + scale B A."""
    adapters = [n for n in state if n.endswith(SUFFIXES)]
    merged = {k: v.clone() for k, v in state.items() if k not in adapters}
    for module in adapted_modules(state):
        merged[f"{module}.weight"] += scale * (state[f"{module}.lora_b.weight"]
                                               @ state[f"{module}.lora_a.weight"])
    return merged


def adapter_state(state: dict, trained=()) -> dict:
    """The adapters and the other ``trained`` tensors (e.g. a new head), by name: what a
    fine-tuned model adds to the one it started from."""
    keep = {n for n in state if n.endswith(SUFFIXES)} | set(trained)
    return {k: v.clone() for k, v in state.items() if k in keep}


def import_peft():
    """The ``peft`` package, imported quietly (pipelines/quiet.py: it imports torchao)."""
    from pipelines.quiet import quiet_import

    return quiet_import("peft")
