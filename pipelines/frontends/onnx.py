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
from pipelines.schema import ConfigError

IMPORTED = "model.onnx"
# buffers transformers' models register (rotary frequencies, position and token-type ids): a
# folded one changes nothing a step trains, so it is no reason to refuse the file (the file
# does not say which folded values were buffers)
BUFFERS = {"inv_freq", "original_inv_freq", "position_ids", "token_type_ids"}


class Config(ModelBase):
    """models.<name> with frontend onnx: ``source`` an .onnx file."""

    frontend: Literal["onnx"]
    # sizes of the inputs' symbolic dimensions other than the batch, by the names the export
    # gave them ({sequence: 128}); a compiled step has static shapes
    dims: dict[str, PositiveInt] = {}
    # parameters the exporter folded into constants: an error (the step would silently differ
    # from the exported model), or left frozen at their exported values
    folded: Literal["error", "frozen"] = "error"


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The file with its batch and dimensions fixed, checked for ops TVM cannot convert, as
    ``model.onnx``; and its layers.json. ``weights``: unused (the file holds its weights)."""
    import onnx

    from pipelines.frontends.layers import describe_onnx
    from pipelines.frontends.onnx_graph import (check_supported, frozen_by_export, load_onnx,
                                                prepare, trainable)

    source = ROOT / model.source
    proto = prepare(load_onnx(source), model.batch_size, source, model.dims)
    lost = [n for n in frozen_by_export(proto) if n.rsplit(".", 1)[-1] not in BUFFERS]
    if lost and model.folded == "error":
        raise ConfigError(
            f"{source}: the exporter folded parameters into constants with other values, so a "
            f"step could not train them: {lost}. Export without constant folding to keep them "
            "(torch.onnx.export(model, args, path, dynamo=True, optimize=False)), or set "
            "models.<name>.folded: frozen to train the rest (allowed: error, frozen)")
    check_supported(proto.graph, source)
    onnx.save(proto, str(out / IMPORTED))
    layers = describe_onnx(proto, trainable(proto), model.blocks)
    write_json_atomic(out / "layers.json", layers)
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
