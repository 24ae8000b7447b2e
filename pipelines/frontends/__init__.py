"""Frontends: a model from its source to the one Relax function every later phase takes,

    main(*inputs, *parameters, *buffers) -> (logits, *new_buffers)

with a name table (Relax name -> parameter or buffer, and its name in the source), an origin
table (binding -> source layer) and layers.json (what schemes select from): a
pipelines/phases.py ``Lowered``.

A frontend is a module here, registered in FRONTENDS (pipelines/registry.py), with
    Config                       its model section (frontends/base.py's ModelBase and its own
                                 keys), tagged by ``frontend``
    import_model(model, weights, out) -> str
                                 the model imported into ``out`` (the import stage), from the
                                 weights stage's directory; a one-line summary
    lower(model, imported) -> (main, names, origins, values)
                                 the imported files as Relax (the lower stage)
optionally
    data_source(model) -> pipelines.data.Source
                                 what the model's data kinds read of it (its tokenizer's
                                 directory, vocabulary size, image preprocessing; default: the
                                 ``kwargs`` vocab and image_size of a model file)
and, for a model PyTorch trains (``Config.in_pytorch``: its twin, pre-training, the peers),
    load_module(model) -> (nn.Module, example inputs by forward's names)
The frontends: a PyTorch model file or torch.export program (torch_module.py; exported with
torch.export, lowered by torch_program.py), a transformers directory (transformers.py), an ONNX
file (onnx.py; onnx_graph.py), a JAX model file and a Keras file, both through StableHLO
(jax.py, keras.py; stablehlo.py).
"""
from __future__ import annotations

from pathlib import Path

from pipelines.io import read_json
from pipelines.registry import entries, tagged_union
from pipelines.schema import ConfigError

FRONTENDS = entries(__name__, ("torch_module", "transformers", "onnx", "jax", "keras"),
                    "frontend")
Model = tagged_union(FRONTENDS, "frontend")  # a model's section (conf/model/<name>.yaml)


def import_model(model, weights: Path, out: Path) -> str:
    """The model (a model section) imported into ``out``, starting from the weights in
    ``weights`` (the weights stage's directory; torch models); a one-line summary."""
    return FRONTENDS[model.frontend].import_model(model, Path(weights), Path(out))


def lower_model(model, imported: Path):
    """``import_model``'s files as Relax, with the layers schemes select from: a Lowered."""
    from pipelines.io import verified_dir
    from pipelines.phases import LAYERS, Lowered

    verified_dir(imported)  # the frontends read their files themselves
    main, names, origins, values = FRONTENDS[model.frontend].lower(model, Path(imported))
    return Lowered(main, names, origins, values, read_json(Path(imported) / LAYERS))


def data_source(model):
    """What the model's data kinds may read of it (pipelines/data: Source)."""
    from pipelines.data import Source

    own = getattr(FRONTENDS[model.frontend], "data_source", None)
    if own is not None:
        return own(model)
    kwargs = getattr(model, "kwargs", {})
    classes = kwargs.get("num_classes") if model.task == "classification" else None
    return Source(vocabulary=kwargs.get("vocab") or kwargs.get("vocab_size"),
                  config={k: kwargs[k] for k in ("image_size",) if k in kwargs},
                  classes=classes, classes_key="kwargs.num_classes")


def load_module(model):
    """(module, example inputs) of a model PyTorch trains, freshly initialised (the caller
    seeds torch)."""
    frontend = FRONTENDS[model.frontend]
    if not model.in_pytorch:
        raise ConfigError(f"a PyTorch module needs a model of frontend "
                          f"{sorted(k for k, f in FRONTENDS.items() if f.Config.in_pytorch)}; "
                          f"this one's frontend is {model.frontend!r}")
    return frontend.load_module(model)
