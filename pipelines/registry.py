"""Registries of the extension points: frontends (pipelines/frontends), data kinds
(pipelines/data), runners (pipelines/runtime/runners) and peers (pipelines/peers).

An entry is one module with the functions its kind's protocol names (each registry's package
docstring says which) and, where it has settings, a ``Config``: its section of the schema (a
``schema.Strict`` model) whose tag field (``frontend``, ``kind``) holds the entry's name as a
``Literal``; an entry without settings (a peer, a runner) is named by its module. A registry is the tuple of its entries' module names, in its package: adding an
entry is its module, one name there, and its conf/ entry. Entry modules import their heavy
libraries (torch, TVM, ONNX, JAX) inside functions, so that the schema loads in a blink
(tests/test_architecture.py checks it).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Annotated, Union, get_args

from pydantic import Field


def entries(package: str, modules: tuple[str, ...], tag: str | None = None
            ) -> dict[str, ModuleType]:
    """Name -> module, for ``modules`` of ``package``, each named by its Config's ``tag`` (or,
    for an entry without a section of its own, by its module name)."""
    found = {}
    for module_name in modules:
        module = importlib.import_module(f"{package}.{module_name}")
        if tag is None:
            found[module_name] = module
            continue
        (name,) = get_args(module.Config.model_fields[tag].annotation)
        found[name] = module
    return found


def tagged_union(registry: dict[str, ModuleType], tag: str):
    """The schema type of a section that is one of the registry's entries, by its ``tag``."""
    configs = tuple(module.Config for module in registry.values())
    return Annotated[Union[configs], Field(discriminator=tag)]
