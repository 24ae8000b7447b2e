"""The PyTorch twin of a compiled step: the model's own module (its source file), with the same
LoRA adapters, holding the step's initial values, so both start from the same state."""
from __future__ import annotations

import numpy as np
import torch

from pipelines.frontends import load_module
from pipelines.frontends.torch_module import is_program
from pipelines.models.pytorch import hold_statistics
from pipelines.models.torch_lora import add_adapters, adapted_modules
from pipelines.schema import ConfigError
from pipelines.stored_weights import as_read


def torch_twin(model, signature: dict, initial: dict[str, np.ndarray],
               adapters: bool = True) -> torch.nn.Module:
    """The twin of the step with ``signature`` starting from ``initial`` (values by Relax
    name); without its LoRA adapters when ``adapters`` is false (the plain model)."""
    if not model.in_pytorch:
        raise ConfigError("a PyTorch twin needs a torch or transformers model; this one's "
                          f"frontend is {model.frontend!r}")
    module, _ = load_module(model)
    names = signature["source_names"]
    lora = signature.get("lora")
    if lora and adapters and is_program(model):
        # the program's graph reads its weights directly: a module put beside one is never run
        raise ConfigError(f"{model.source}: a saved torch.export program has no PyTorch twin "
                          "with LoRA adapters; use a scheme without lora, or a model file")
    held = signature.get("frozen_statistics", [])
    if held and is_program(model):
        raise ConfigError(f"{model.source}: a saved torch.export program runs its batch norms as "
                          "exported (training mode), so its PyTorch twin cannot hold the "
                          f"statistics of the frozen layers {held[:3]}; set the scheme's "
                          "statistics: every_layer, or use a model file")
    if lora and adapters:
        add_adapters(module, adapted_modules(names.values()), lora["rank"], lora["scale"])
    # the values the step reads: a weight it stores narrower, rounded as stored and widened
    # again (the twin computes in float32, as the step does)
    state = {names[r]: torch.from_numpy(np.array(v))
             for r, v in as_read(signature, initial).items() if r in names}
    if not adapters:
        state = {k: v for k, v in state.items() if not k.endswith((".lora_a.weight",
                                                                   ".lora_b.weight"))}
    # A tied parameter (GPT-2's head and embeddings) has several names and one value: the
    # export keeps one of them.
    tied = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    aliases = {name: names for names in tied.values() for name in names}
    missing = [k for k in module.state_dict() if k not in state
               and not any(a in state for a in aliases.get(k, ()))
               and not k.endswith("num_batches_tracked")]  # a fixed momentum never reads it
    if missing:
        raise KeyError(f"the step holds no initial value for {missing[:5]}")
    module.load_state_dict(state, strict=False)
    return hold_statistics(module.train(), held)


def step_batch(signature: dict, *batch: np.ndarray) -> tuple[np.ndarray, ...]:
    """A batch (the model's inputs, then the labels) as the step takes it: labels in the
    step's shape (a decoder that flattens its logits to one row per token takes one label per
    token)."""
    *inputs, labels = batch
    return (*inputs, np.ascontiguousarray(labels).reshape(signature["labels_shape"]))
