"""Frontends: a model from its source to the one Relax function every later phase takes,

    main(*inputs, *parameters, *buffers) -> (logits, *new_buffers)

with a name table (Relax name -> parameter or buffer, and its name in the source), an origin
table (binding -> source layer) and layers.json (what schemes select from). One module per
source: a PyTorch model file (torch_module.py, exported with torch.export, torch_program.py),
an ONNX file (onnx.py), a JAX model file or a Keras file, both through StableHLO (jax.py,
keras.py, stablehlo.py).

``import_model`` writes a model's imported form (the import stage); ``lower_model`` reads it
back as Relax (the lower stage).
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipelines.frontends.layers import describe_layers, describe_onnx, describe_program
from pipelines.frontends.torch_module import is_program
from pipelines.frontends.weights import FILE as WEIGHTS, load_weights
from pipelines.io import ROOT, write_json_atomic


def import_model(model, weights: Path, out: Path) -> str:
    """The model (a pipelines/config.py Model) imported into ``out``, starting from the weights
    in ``weights`` (the weights stage's directory; torch models); a one-line summary."""
    source = ROOT / model.source
    if model.frontend == "torch" and is_program(model):
        from pipelines.frontends.torch_module import check_batch, load_program, with_weights

        program = with_weights(load_program(source), load_weights(weights / WEIGHTS), source)
        check_batch(program, model, source)
        torch.export.save(program, out / "model.pt2")
        write_json_atomic(out / "layers.json", describe_program(program, model.blocks))
        return f"loaded {source.name}: {len(program.graph.nodes)} graph nodes"
    if model.in_pytorch:
        from pipelines.frontends.torch_module import export, load_module

        module, inputs = load_module(model)
        module.load_state_dict(load_weights(weights / WEIGHTS))
        program = export(module, inputs)
        torch.export.save(program, out / "model.pt2")
        write_json_atomic(out / "layers.json", describe_layers(module, model.blocks))
        what = f"{source.name}:{model.entry}" if model.entry else type(module).__name__
        return f"exported {what}: {len(program.graph.nodes)} graph nodes"
    if model.frontend == "onnx":
        import onnx

        from pipelines.frontends.onnx import (check_supported, frozen_by_export, load_onnx,
                                              prepare, trainable)

        proto = prepare(load_onnx(source), model.batch_size, source, model.dims)
        check_supported(proto.graph, source)
        onnx.save(proto, str(out / "model.onnx"))
        layers = describe_onnx(proto, trainable(proto), model.blocks)
        write_json_atomic(out / "layers.json", layers)
        lost = frozen_by_export(proto)
        return (f"imported {source}: {len(proto.graph.node)} ONNX nodes, "
                f"{len(layers['parameters'])} trainable parameters"
                + (f"; folded into constants by the exporter, so frozen: {lost}" if lost else ""))
    from pipelines.frontends.jax import import_stablehlo

    return import_stablehlo(model, source, out)


def lower_model(model, imported: Path):
    """(main, names, origins, initial values by Relax name) from ``import_model``'s files."""
    if model.in_pytorch:
        from pipelines.frontends.torch_program import lower_program

        return lower_program(imported / "model.pt2")
    if model.frontend == "onnx":
        from pipelines.frontends.onnx import initial_values, load_onnx, translate_onnx

        proto = load_onnx(imported / "model.onnx")
        func, names, origins = translate_onnx(proto, model.source)  # errors name the user's file
        return func, names, origins, initial_values(proto, names)
    from pipelines.frontends.jax import lower_stablehlo

    return lower_stablehlo(imported)
