"""A LoRA case's adapters as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that ``peft.PeftModel.from_pretrained`` puts on the base model.

The step's adapters (training/lora.py) are PEFT's LoRA: ``lora_a`` (r x in) is PEFT's
``lora_A``, ``lora_b`` (out x r) its ``lora_B``, scaled by alpha / r as PEFT scales them; any
other tensor the scheme trains (a new classification head) goes in ``modules_to_save``. The
directory is written by PEFT itself: the model wrapped with ``get_peft_model``, the fine-tuned
values loaded, ``save_pretrained``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipelines.models.torch_lora import SUFFIXES, adapted_modules, import_peft

TASK_TYPES = {"causal_lm": "CAUSAL_LM", "classification": "SEQ_CLS"}


def save_adapter(base: torch.nn.Module, weights: dict[str, torch.Tensor], rank: int,
                 alpha: float, trained: list[str], task: str, base_name: str,
                 directory: Path) -> None:
    """``weights`` (the step's, by the source's names, adapters included) as PEFT's adapter
    for ``base`` (the plain transformers model, which this wraps in place) in ``directory``:
    adapters of ``rank`` scaled by ``alpha`` / rank; ``trained`` what the step trains,
    ``base_name`` what the config records as the base model."""
    peft = import_peft()
    modules = adapted_modules(weights)
    others = sorted({name.rpartition(".")[0] for name in trained
                     if not name.endswith(SUFFIXES)})
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                             target_modules=modules, modules_to_save=others or None, bias="none",
                             task_type=TASK_TYPES.get(task), base_model_name_or_path=base_name)
    # else PEFT records where this machine found it (its model card reads the config's)
    base.name_or_path = base.config.name_or_path = base_name
    wrapped = peft.get_peft_model(base, config)
    values = {}
    for module in modules:
        for ours, theirs in zip(SUFFIXES, ("lora_A", "lora_B")):
            values[f"base_model.model.{module}.{theirs}.default.weight"] = weights[module + ours]
    for module in others:
        for name, tensor in weights.items():
            if name.startswith(module + "."):
                leaf = name[len(module) + 1:]
                values[f"base_model.model.{module}.modules_to_save.default.{leaf}"] = tensor
    missing = [n for n in values if n not in wrapped.state_dict()]
    if missing:
        raise KeyError(f"PEFT's model has no {missing[:3]}")
    wrapped.load_state_dict(values, strict=False)
    # the embeddings are never an adapter's (PEFT would save them where a config override
    # changed the vocabulary's size)
    wrapped.save_pretrained(str(directory), save_embedding_layers=False)
    # PEFT keeps the module lists as sets, written in hash order: sorted, the file is the same
    # on every run
    path = Path(directory) / "adapter_config.json"
    saved = json.loads(path.read_text())
    for key in ("target_modules", "modules_to_save"):
        if isinstance(saved.get(key), list):
            saved[key] = sorted(saved[key])
    path.write_text(json.dumps(saved, indent=2, sort_keys=True))
