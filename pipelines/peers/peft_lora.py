"""PEFT's LoRA (the `peft` package) on the plain model, as a Hugging Face user adds adapters: the
same rank, scale and target modules as the case's LoRA scheme, the base frozen, the same
optimizer over the adapters. Its adapters start as PEFT initialises them (a speed peer: what it
computes per step is the compiled LoRA step's)."""
from __future__ import annotations

WORK = "pruned"


def cannot_time(signature: dict, model) -> str | None:
    return None if signature.get("lora") else "PEFT LoRA times LoRA cases (a scheme with lora:)"


def peft_model(model_section, signature, initial):
    """The plain model from ``initial`` with PEFT's adapters where the case's scheme puts its
    own, and the names of what it trains (the adapters): what this peer trains, here and in
    a device's container (evaluate/container_peers.py). PEFT draws the adapters' A matrices
    from a fixed seed, so the same case gives the same model each time."""
    import torch

    from pipelines.frontends.twin import torch_twin
    from pipelines.models.torch_lora import adapted_modules, import_peft

    lora = signature.get("lora")
    if lora is None:
        raise ValueError("the peft_lora peer times LoRA cases only (a scheme with lora:)")
    names = signature["source_names"].values()
    model = torch_twin(model_section, signature, initial, adapters=False)
    peft = import_peft()
    config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["scale"] * lora["rank"],
                             target_modules=adapted_modules(names), lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = peft.get_peft_model(model, config)
    return model, [n for n, p in model.named_parameters() if p.requires_grad]


def make_step(spec, signature, batch):
    import torch

    from pipelines.models.pytorch import make_optimizer, train_step

    model, trainable = peft_model(spec.model, signature, spec.initial)
    model = model.to(spec.device)
    optimizer = make_optimizer(model, spec.optimizer, trainable)
    tensors = [torch.from_numpy(a).to(spec.device) for a in batch]
    return lambda: train_step(model, optimizer, *tensors, task=signature["task"])
