"""import: the model to fine-tune, from its frontend (``model.frontend``), with its weights.

- torch: the reference model (pipelines/models.py) with the pretrain stage's weights
  (``model.source``), through torch.export.
- onnx: the ONNX file ``model.source``, checked; its initializers are the weights.
- jax: the Python file ``model.source``, whose function ``model.entry`` (batch size) returns
  ``(apply, params, example input)``; ``apply(params, x)`` is lowered to StableHLO.
- keras: the Keras model file ``model.source`` (.keras), run on Keras's JAX backend and lowered
  to StableHLO the same way (stages/importer/from_keras.py says why not TFLite or ONNX).

Outputs (artifacts/import/):
  model.pt2    torch: the exported program (training mode: batch norm uses batch statistics)
  model.onnx   torch: the same model as ONNX (inference mode), the interchange format;
               onnx: the file itself, its input's batch dimension fixed to model.batch_size
  model.mlir   jax, keras: the StableHLO program, main(*parameters, x) -> logits
  weights.npz  jax, keras: the parameters' and buffers' values, by name (JAX tree path joined
               with ".", Keras variable path)
  state.json   jax, keras: which of those are parameters and which buffers (Keras's
               non-trainable variables, e.g. batch-norm moving statistics)
  layers.json  every parameter with its module path, layer kind and block: what schemes select
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from pipelines.artifacts import (ARTIFACTS, ROOT, atomic_dir, save_arrays, write_json_atomic,
                                 write_manifest, write_text_atomic)
from pipelines.config import PARAMS, ConfigError, choose, load_params, require, run_stage
from pipelines.models import build_model, example_input
from stages.importer.layers import describe_layers, describe_onnx, describe_parameters

OUT = ARTIFACTS / "import"
FRONTENDS = {"torch", "onnx", "jax", "keras"}


def import_torch(model_cfg: dict, weights: Path, out: Path) -> str:
    model = build_model(model_cfg)
    model.load_state_dict(torch.load(weights, weights_only=True))
    x = example_input(model_cfg)
    program = torch.export.export(model.train(), (x,))
    onnx_bytes = io.BytesIO()
    torch.onnx.export(model.eval(), (x,), onnx_bytes, dynamo=False, input_names=["x"],
                      output_names=["logits"], do_constant_folding=False)
    torch.export.save(program, out / "model.pt2")
    (out / "model.onnx").write_bytes(onnx_bytes.getvalue())
    write_json_atomic(out / "layers.json", describe_layers(model))
    return f"exported {model_cfg['arch']}: {len(program.graph.nodes)} graph nodes"


def import_onnx(model_cfg: dict, path: Path, out: Path) -> str:
    import onnx

    from stages.lower.from_onnx import check_supported, load_onnx, prepare, trainable

    model = prepare(load_onnx(path), int(require({"model": model_cfg}, "model.batch_size")), path)
    check_supported(model.graph, path)
    onnx.save(model, str(out / "model.onnx"))
    layers = describe_onnx(model, trainable(model), list(model_cfg.get("blocks") or []))
    write_json_atomic(out / "layers.json", layers)
    return (f"imported {path}: {len(model.graph.node)} ONNX nodes, "
            f"{len(layers['parameters'])} trainable parameters")


def load_jax_file(model_cfg: dict, path: Path):
    """(apply, params, example input) from the JAX model file ``path``'s ``model.entry``."""
    import importlib.util

    try:
        import jax  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"{PARAMS}: model.frontend=jax needs JAX: pip install -e '.[jax]' "
                          f"({err})") from err
    entry = str(require({"model": model_cfg}, "model.entry"))
    spec = importlib.util.spec_from_file_location(f"pock_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, entry, None)):
        raise ConfigError(f"{path}: no function {entry!r} (model.entry)")
    return getattr(module, entry)(int(require({"model": model_cfg}, "model.batch_size")))


def import_stablehlo(model_cfg: dict, path: Path, out: Path) -> str:
    """The jax and keras frontends: the model's function lowered to StableHLO."""
    import numpy as np

    from stages.importer.from_keras import load_keras_file
    from stages.lower.from_stablehlo import parameter_kinds, stablehlo_text

    keras = model_cfg["frontend"] == "keras"
    if keras:  # each loader says which extra to install if its framework is missing
        apply, params, example, buffers, kinds = load_keras_file(
            path, int(require({"model": model_cfg}, "model.batch_size")))
    else:
        (apply, params, example), buffers, kinds = load_jax_file(model_cfg, path), None, None
    import jax

    text, names, buffer_names = stablehlo_text(apply, params, np.asarray(example), buffers)
    values = [np.asarray(v) for v in jax.tree_util.tree_leaves(params)]
    state = [np.asarray(v) for v in jax.tree_util.tree_leaves(buffers or {})]
    write_text_atomic(out / "model.mlir", text)
    save_arrays(out / "weights.npz", dict(zip(names + buffer_names, values + state)))
    write_json_atomic(out / "state.json", {"parameters": names, "buffers": buffer_names})
    kinds = kinds or parameter_kinds(text, names)  # Keras says; for JAX, the ops using them
    layers = describe_parameters([(n, kinds.get(n, "other"), list(v.shape))
                                  for n, v in zip(names, values)],
                                 list(model_cfg.get("blocks") or []),
                                 "keras" if keras else "torch")
    write_json_atomic(out / "layers.json", layers)
    return f"imported {path}: {len(names)} parameters, {text.count(chr(10))} lines of StableHLO"


def main() -> None:
    params = load_params()
    model_cfg = require(params, "model")
    frontend = choose(model_cfg.get("frontend"), FRONTENDS, "model.frontend")
    source = ROOT / str(require(params, "model.source"))
    if not source.exists():
        raise SystemExit(f"import: {PARAMS}: model.source={str(source)!r} does not exist")
    with atomic_dir(OUT) as tmp:
        done = {"torch": import_torch, "onnx": import_onnx, "jax": import_stablehlo,
                "keras": import_stablehlo}[frontend](model_cfg, source, tmp)
        write_manifest(tmp, "import", {"source": source}, {"model": model_cfg})
    print(done)


if __name__ == "__main__":
    run_stage(main)
