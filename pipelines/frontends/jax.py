"""A JAX model from a Python file, and the import of any model that lowers to StableHLO (JAX's,
and Keras's run on its JAX backend: keras.py).

``source`` defines ``entry(batch_size)`` returning ``(apply, params, example input)``, with
``apply(params, x) -> logits``. ``jax.jit(apply).lower`` gives StableHLO text (stablehlo.py
turns it into Relax); the parameters are the leaves of ``params`` under their tree paths joined
with "." ({"conv1": {"weight": w}} -> conv1.weight), which schemes select as they select a
PyTorch module's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.config import ConfigError
from pipelines.frontends.layers import describe_parameters
from pipelines.frontends.stablehlo import parameter_kinds, stablehlo_text
from pipelines.frontends.torch_module import load_file
from pipelines.io import save_arrays, write_json_atomic, write_text_atomic


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


def import_stablehlo(model, path: Path, out: Path) -> str:
    """The jax and keras frontends: the model's function lowered to StableHLO, written with its
    weights (weights.npz), which of them are buffers (state.json) and layers.json."""
    import jax

    from pipelines.frontends.keras import load_keras_file

    keras = model.frontend == "keras"
    if keras:  # each loader says which extra to install if its framework is missing
        apply, params, example, buffers, kinds = load_keras_file(path, model.batch_size)
    else:
        (apply, params, example), buffers, kinds = load_jax_file(model, path), None, None
    text, names, buffer_names = stablehlo_text(apply, params, np.asarray(example), buffers)
    values = [np.asarray(v) for v in jax.tree_util.tree_leaves(params)]
    state = [np.asarray(v) for v in jax.tree_util.tree_leaves(buffers or {})]
    write_text_atomic(out / "model.mlir", text)
    save_arrays(out / "weights.npz", dict(zip(names + buffer_names, values + state)))
    write_json_atomic(out / "state.json", {"parameters": names, "buffers": buffer_names})
    kinds = kinds or parameter_kinds(text, names)  # Keras says; for JAX, the ops using them
    layers = describe_parameters([(n, kinds.get(n, "other"), list(v.shape))
                                  for n, v in zip(names, values)], model.blocks,
                                 "keras" if keras else "torch")
    write_json_atomic(out / "layers.json", layers)
    return f"imported {path}: {len(names)} parameters, {text.count(chr(10))} lines of StableHLO"


def lower_stablehlo(imported: Path):
    """``main``, names, origins and initial values from import_stablehlo's files."""
    import json

    from pipelines.frontends.stablehlo import translate_stablehlo
    from pipelines.io import load_arrays

    path = imported / "model.mlir"
    state = json.loads((imported / "state.json").read_text())
    values = load_arrays(imported / "weights.npz")
    func, names, origins = translate_stablehlo(path.read_text(), state["parameters"], path,
                                               state["buffers"])
    return func, names, origins, {r: values[n] for r, (_, n) in names.items()}
