"""A JAX model from a Python file, and the import of any model that lowers to StableHLO (JAX's,
and Keras's run on its JAX backend: keras.py).

``source`` defines ``entry(batch_size)`` returning ``(apply, params, example input)``, with
``apply(params, x) -> logits``. ``jax.jit(apply).lower`` gives StableHLO text (stablehlo.py
turns it into Relax); the parameters are the leaves of ``params`` under their tree paths joined
with "." ({"conv1": {"weight": w}} -> conv1.weight), which schemes select as they select a
PyTorch module's.

The frontend ``jax`` (pipelines/frontends/__init__.py); keras.py takes the same path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pipelines.frontends.base import ModelBase
from pipelines.frontends.python_file import load_file
from pipelines.io import ROOT
from pipelines.schema import ConfigError


class Config(ModelBase):
    """models.<name> with frontend jax: ``source`` a Python file, ``entry`` the function in it
    that returns (apply, params, example input)."""

    frontend: Literal["jax"]
    entry: str


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The model's function lowered to StableHLO (``weights``: unused, the file holds them),
    and layers.json (a parameter's kind from the ops that use it)."""
    from pipelines.frontends.stablehlo import write_stablehlo

    path = ROOT / model.source
    apply, params, example = load_jax_file(model, path)
    return write_stablehlo(apply, params, example, None, None, model.blocks, "torch", path, out)


def lower(model: Config, imported: Path):
    from pipelines.frontends.stablehlo import read_stablehlo

    return read_stablehlo(imported)


def load_jax_file(model, path: Path):
    """(apply, params, example input) from the JAX model file's ``entry``."""
    try:
        import jax  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"models.<name>.frontend=jax needs JAX: pip install -e '.[jax]' "
                          f"({err})") from err
    entry = getattr(load_file(path, "models.<name>.source"), model.entry, None)
    if not callable(entry):
        raise ConfigError(f"{path}: no function {model.entry!r} (models.<name>.entry)")
    return entry(model.batch_size)
