"""A Keras model file (``.keras``, saved by Keras 3 under any backend, TensorFlow's included) as
the JAX frontend takes a model: ``(apply, params, example input)``.

Keras 3 runs the model on its JAX backend, where ``stateless_call`` is a pure function of the
model's variables; it is lowered to StableHLO like any JAX model. The parameters keep Keras's
variable paths ("sequential/conv1/kernel"), so schemes select Keras layers by name. Why not
TFLite or ONNX: a TFLite conversion folds and renames weights (a dense kernel becomes a
transposed constant, activations fuse into convolutions), and Keras's ONNX export names
initializers after graph nodes ("onnx::Conv_54"); both lose what schemes select by. TensorFlow
itself is not needed to train a Keras model here.

The frontend ``keras`` (pipelines/frontends/__init__.py), through jax.py's StableHLO path.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from pipelines.frontends.base import ModelBase
from pipelines.io import ROOT
from pipelines.schema import ConfigError


class Config(ModelBase):
    """models.<name> with frontend keras: ``source`` a .keras file."""

    frontend: Literal["keras"]


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The model's ``stateless_call`` lowered to StableHLO (``weights``: unused, the file holds
    them), and layers.json (a variable's kind from its Keras layer)."""
    from pipelines.frontends.stablehlo import write_stablehlo

    path = ROOT / model.source
    apply, params, example, buffers, kinds = load_keras_file(path, model.batch_size)
    return write_stablehlo(apply, params, example, buffers, kinds, model.blocks, "keras", path,
                           out)


def lower(model: Config, imported: Path):
    from pipelines.frontends.stablehlo import read_stablehlo

    return read_stablehlo(imported)


def load_keras():
    """Keras on its JAX backend (set before Keras is first imported)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
        import keras
    except ImportError as err:
        raise ConfigError(f"params.yaml: model.frontend=keras needs Keras and JAX: pip install -e "
                          f"'.[keras]' ({err})") from err
    if keras.backend.backend() != "jax":
        raise ConfigError(f"KERAS_BACKEND={keras.backend.backend()!r}: the keras frontend runs "
                          "Keras on JAX; unset KERAS_BACKEND or set it to jax")
    return keras


def keras_function(model, batch_size: int):
    """(apply, params, example input, buffers) for a built Keras model, by variable path:
    ``apply(params, buffers, x)`` runs the model in training mode and returns (logits, new
    buffers); buffers are its non-trainable variables, such as batch-norm moving statistics,
    which Keras updates itself."""
    if len(model.inputs) != 1:
        raise ConfigError(f"Keras model {model.name!r}: a model to fine-tune takes one input; "
                          f"this one takes {len(model.inputs)}")
    stateful = [v.path for v in model.non_trainable_variables
                if not np.issubdtype(np.dtype(v.dtype), np.floating)]
    if stateful:  # e.g. a dropout layer's random seed
        raise ConfigError(f"Keras model {model.name!r}: non-float state {stateful[:4]} (random "
                          "layers such as Dropout) is not supported")
    paths = [v.path for v in model.trainable_variables]
    buffer_paths = [v.path for v in model.non_trainable_variables]
    params = {p: np.asarray(v.value) for p, v in zip(paths, model.trainable_variables)}
    buffers = {p: np.asarray(v.value) for p, v in zip(buffer_paths,
                                                       model.non_trainable_variables)}

    def apply(params, buffers, x):
        logits, new = model.stateless_call([params[p] for p in paths],
                                           [buffers[p] for p in buffer_paths], x, training=True)
        return logits, dict(zip(buffer_paths, new))

    shape = [batch_size if d is None else int(d) for d in model.inputs[0].shape]
    return apply, params, np.zeros(shape, model.inputs[0].dtype), buffers


def keras_kinds(model) -> dict[str, str]:
    """The layer kind of each trainable variable, from its Keras layer's class."""
    keras = load_keras()
    layers = keras.layers
    kinds = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, layers.DepthwiseConv2D):
            kind = "conv_depthwise"
        elif isinstance(layer, layers.Conv2D):
            kind = "conv_pointwise" if tuple(layer.kernel_size) == (1, 1) else "conv"
        elif isinstance(layer, layers.Dense):
            kind = "linear"
        elif isinstance(layer, (layers.BatchNormalization, layers.LayerNormalization)):
            kind = "norm"
        elif isinstance(layer, layers.Embedding):
            kind = "embedding"
        else:
            kind = "other"
        kinds.update({v.path: kind for v in layer.trainable_variables})
    return kinds


def load_keras_file(path: Path, batch_size: int):
    keras = load_keras()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such Keras model file (model.source)")
    try:
        model = keras.saving.load_model(path, compile=False)
    except (ValueError, OSError) as err:
        raise ConfigError(f"{path}: not a Keras model file ({str(err).strip()[:300]})") from err
    return (*keras_function(model, batch_size), keras_kinds(model))
