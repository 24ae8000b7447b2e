"""What sparse schemes select from: every parameter with its module path, layer kind and block."""
from __future__ import annotations

import torch

from pipelines.models import RMSNorm


def layer_kind(module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.Conv2d):
        if module.groups > 1 and module.groups == module.in_channels == module.out_channels:
            return "conv_depthwise"
        if module.kernel_size == (1, 1) and module.groups == 1:
            return "conv_pointwise"
        return "conv"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm,
                           RMSNorm)):
        return "norm"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    return type(module).__name__.lower()


def describe_layers(model: torch.nn.Module) -> dict:
    """Per parameter: module path, layer kind, role (weight/bias), block index, shape."""
    blocks = model.blocks()
    params = []
    for module_path, module in model.named_modules():
        for role, param in module.named_parameters(recurse=False):
            block = next((i for i, b in enumerate(blocks)
                          if module_path == b or module_path.startswith(b + ".")), None)
            params.append({"name": f"{module_path}.{role}", "module": module_path,
                           "kind": layer_kind(module), "role": role, "block": block,
                           "shape": list(param.shape)})
    return {"blocks": blocks, "parameters": params}
