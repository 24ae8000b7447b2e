"""A PyTorch model from a Python file: ``source`` defines a function ``entry`` that takes the batch
size (and the model's ``kwargs``) and returns the ``nn.Module`` and an example batch of its
inputs, a dict by the names ``forward`` takes:

    def build(batch_size, width=1.0):
        model = MyNet(width)
        return model, {"x": torch.zeros(batch_size, 3, 32, 32)}

The reference models are such files (pipelines/models/). The module is exported with
torch.export in training mode (batch norm uses batch statistics) and lowered by
torch_program.py; its parameters keep their state-dict names.
"""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import torch

from pipelines.config import ConfigError
from pipelines.io import ROOT


def load_file(path: Path, what: str):
    """The Python module in ``path``, loaded under a name of its own."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file ({what})")
    spec = importlib.util.spec_from_file_location(f"pock_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_module(model) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(module, example inputs) from a Model config of frontend torch, freshly initialised
    (the caller seeds torch)."""
    path = ROOT / model.source
    entry = getattr(load_file(path, "models.<name>.source"), model.entry, None)
    if not callable(entry):
        raise ConfigError(f"{path}: no function {model.entry!r} (models.<name>.entry)")
    try:
        built = entry(model.batch_size, **model.kwargs)
    except TypeError as err:
        raise ConfigError(f"{path}: {model.entry}(batch_size, **kwargs) failed with kwargs "
                          f"{sorted(model.kwargs)}: {err}") from err
    if (not isinstance(built, tuple) or len(built) != 2
            or not isinstance(built[0], torch.nn.Module) or not isinstance(built[1], dict)):
        raise ConfigError(f"{path}: {model.entry}() must return (nn.Module, {{input name: "
                          f"example tensor}}); it returned {type(built).__name__}")
    module, inputs = built
    accepted = list(inspect.signature(module.forward).parameters)
    unknown = [name for name in inputs if name not in accepted]
    if unknown:
        raise ConfigError(f"{path}: example inputs {unknown} are not arguments of "
                          f"{type(module).__name__}.forward{tuple(accepted)}")
    return module, inputs


def export(module: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    """torch.export of ``module`` in training mode, inputs by name in ``forward``'s order."""
    order = list(inspect.signature(module.forward).parameters)
    ordered = {name: inputs[name] for name in order if name in inputs}
    return torch.export.export(module.train(), (), kwargs=ordered)
