"""LoRA: rank-r adapters beside chosen linear projections (Hu et al., 2021).

A scheme with a ``lora`` section (conf/sparse/minilm_lora.yaml, llama_lora.yaml) adds them:

    lora:
      rank: 8            # r
      alpha: 16          # the adapter's output is scaled by alpha / r
      modules: ["encoder.layer.*.attention.self.query", ...]   # globs or "re:" over module paths
      export: separate   # or merged: how the fine-tuned weights are written (below)

Each matched ``nn.Linear`` becomes a ``LoRALinear`` in place, so every existing name stays
(``...query.weight``) and the adapter is two new linear layers under it, ``...query.lora_a``
(r x in, seeded Kaiming-uniform as in PEFT) and ``...query.lora_b`` (out x r, zeros: a fresh
adapter changes nothing). The scheme's rules then select what trains, usually the adapters and
a new head; the compiler stages see the adapters as ordinary parameters of the exported graph.

Export: ``merged`` folds each adapter into its projection (W + alpha/r * B A), giving a state
dict of the model without adapters; ``separate`` keeps the model's own weights and writes the
adapters beside them (``adapter_state``), to be added back with ``add_adapters``.
"""
from __future__ import annotations

import math
from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.config import PARAMS, ConfigError
from pipelines.patterns import module_matcher

KEYS = {"rank", "alpha", "modules", "export"}
EXPORTS = ("separate", "merged")


class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) * (x A^T) B^T, with W and b the projection's own."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        nn.Module.__init__(self)  # not nn.Linear's: that would draw a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        # skip_init: the adapters are drawn from the caller's generator, not the global one.
        self.lora_a = nn.utils.skip_init(nn.Linear, base.in_features, rank, bias=False)
        self.lora_b = nn.utils.skip_init(nn.Linear, rank, base.out_features, bias=False)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_b(self.lora_a(x)) * self.scale


def check_lora(lora: dict, where: str = f"{PARAMS}: sparse.lora") -> dict:
    """The section, checked; errors name ``where`` and the allowed values."""
    if not isinstance(lora, dict):
        raise ConfigError(f"{where}={lora!r}; allowed: a mapping with rank, alpha, modules")
    unknown = set(lora) - KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(KEYS)}")
    rank = lora.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{where}.rank={rank!r}; allowed: an integer >= 1")
    alpha = lora.get("alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"{where}.alpha={alpha!r}; allowed: a number > 0")
    modules = lora.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str)
                                                                for m in modules):
        raise ConfigError(f"{where}.modules={modules!r}; allowed: a non-empty list of module "
                          "path patterns (globs, or 're:' and a regular expression)")
    for pattern in modules:
        try:
            module_matcher(pattern)
        except ValueError as err:
            raise ConfigError(f"{where}.modules: {err}") from None
    export = lora.get("export", "separate")
    if export not in EXPORTS:
        raise ConfigError(f"{where}.export={export!r}; allowed: {', '.join(EXPORTS)}")
    return {"rank": rank, "alpha": float(alpha), "modules": list(modules), "export": export}


def add_adapters(model: nn.Module, lora: dict, seed: int,
                 where: str = f"{PARAMS}: sparse.lora") -> list[str]:
    """Put an adapter beside every linear projection ``lora.modules`` names, in place; returns
    the adapted module paths. Each pattern must match at least one linear layer."""
    lora = check_lora(lora, where)
    linears = [path for path, m in model.named_modules() if type(m) is nn.Linear]
    adapted: list[str] = []
    for pattern in lora["modules"]:
        matched = [p for p in linears if module_matcher(pattern)(p)]
        if not matched:
            shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
            raise ConfigError(f"{where}.modules: {pattern!r} matches no linear layer of the "
                              f"model; its linear layers: {shown}")
        adapted += [p for p in matched if p not in adapted]
    # One generator, modules in model order: the same seed gives the same adapters everywhere
    # (the compiled step's initial values and the PyTorch reference's).
    generator = torch.Generator().manual_seed(seed)
    for path in [p for p in linears if p in adapted]:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = LoRALinear(getattr(parent, child), lora["rank"], lora["alpha"])
        with torch.no_grad():
            bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT
            layer.lora_a.weight.uniform_(-bound, bound, generator=generator)
            layer.lora_b.weight.zero_()
        setattr(parent, child, layer)
    return [p for p in linears if p in adapted]


def adapted(model: nn.Module, lora: dict | None, seed: int) -> nn.Module:
    """A copy of ``model``, with the adapters of ``lora`` (if any) added: a scheme's starting
    model, the same tensors the compiled step starts from."""
    copy = deepcopy(model)
    if lora:
        add_adapters(copy, lora, seed)
    return copy


def adapter_names(state: dict) -> list[str]:
    return [k for k in state if k.endswith((".lora_a.weight", ".lora_b.weight"))]


def merged_state(state: dict, lora: dict) -> dict:
    """A state dict of the model with adapters -> one of the model without: W + alpha/r B A."""
    lora = check_lora(lora)
    scale = lora["alpha"] / lora["rank"]
    adapters = adapter_names(state)
    merged = {k: v.clone() for k, v in state.items() if k not in adapters}
    for name in adapters:
        if name.endswith(".lora_a.weight"):
            module = name.removesuffix(".lora_a.weight")
            merged[f"{module}.weight"] += scale * (state[f"{module}.lora_b.weight"]
                                                   @ state[name])
    return merged


def adapter_state(state: dict, trained=()) -> dict:
    """The adapters and the other ``trained`` tensors (e.g. a new head), by name: what a
    fine-tuned model adds to the one it started from (``add_adapters``, then load these)."""
    keep = set(adapter_names(state)) | set(trained)
    return {k: v.clone() for k, v in state.items() if k in keep}
