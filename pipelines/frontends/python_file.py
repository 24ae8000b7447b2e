"""A model defined in a Python file (the torch and jax frontends): the file loaded as a module of
its own."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pipelines.schema import ConfigError


def load_file(path: Path, what: str):
    """The Python module in ``path``, loaded under a name of its own."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file ({what})")
    spec = importlib.util.spec_from_file_location(f"pock_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
