"""An ONNX file as a model: the frontend ``onnx`` (pipelines/frontends/__init__.py). The file is
checked and its batch (and any other symbolic dimension, by name) fixed at import; TVM's ONNX
frontend translates it at lower (onnx_graph.py says how parameters and batch norm are read).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import PositiveInt

from pipelines.frontends.base import ModelBase
from pipelines.io import ROOT, write_json_atomic

IMPORTED = "model.onnx"


class Config(ModelBase):
    """models.<name> with frontend onnx: ``source`` an .onnx file."""

    frontend: Literal["onnx"]
    # sizes of the inputs' symbolic dimensions other than the batch, by the names the export
    # gave them ({sequence: 128}); a compiled step has static shapes
    dims: dict[str, PositiveInt] = {}


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The file with its batch and dimensions fixed, checked for ops TVM cannot convert, as
    ``model.onnx``; and its layers.json. ``weights``: unused (the file holds its weights)."""
    import onnx

    from pipelines.frontends.layers import describe_onnx
    from pipelines.frontends.onnx_graph import (check_supported, frozen_by_export, load_onnx,
                                                prepare, trainable)

    source = ROOT / model.source
    proto = prepare(load_onnx(source), model.batch_size, source, model.dims)
    check_supported(proto.graph, source)
    onnx.save(proto, str(out / IMPORTED))
    layers = describe_onnx(proto, trainable(proto), model.blocks)
    write_json_atomic(out / "layers.json", layers)
    lost = frozen_by_export(proto)
    return (f"imported {source}: {len(proto.graph.node)} ONNX nodes, "
            f"{len(layers['parameters'])} trainable parameters"
            + (f"; folded into constants by the exporter, so frozen: {lost}" if lost else ""))


def lower(model: Config, imported: Path):
    """(main, names, origins, initial values) through TVM's ONNX frontend; errors name the
    user's file."""
    from pipelines.frontends.onnx_graph import initial_values, load_onnx, translate_onnx

    proto = load_onnx(imported / IMPORTED)
    func, names, origins = translate_onnx(proto, model.source)
    return func, names, origins, initial_values(proto, names)
