"""import: the model to fine-tune, from its frontend (``model.frontend``), with its weights.

- torch: the reference model (pipelines/models.py) with the pretrain stage's weights
  (``model.source``), through torch.export.
- onnx: the ONNX file ``model.source``, checked; its initializers are the weights.

Outputs (artifacts/import/):
  model.pt2    torch: the exported program (training mode: batch norm uses batch statistics)
  model.onnx   torch: the same model as ONNX (inference mode), the interchange format;
               onnx: the file itself, its input's batch dimension fixed to model.batch_size
  layers.json  every parameter with its module path, layer kind and block: what schemes select
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from pipelines.artifacts import ROOT, ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import PARAMS, choose, load_params, require, run_stage
from pipelines.models import build_model, example_input
from stages.importer.layers import describe_layers, describe_onnx

OUT = ARTIFACTS / "import"
FRONTENDS = {"torch", "onnx"}


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


def main() -> None:
    params = load_params()
    model_cfg = require(params, "model")
    frontend = choose(model_cfg.get("frontend"), FRONTENDS, "model.frontend")
    source = ROOT / str(require(params, "model.source"))
    if not source.exists():
        raise SystemExit(f"import: {PARAMS}: model.source={str(source)!r} does not exist")
    with atomic_dir(OUT) as tmp:
        done = (import_torch if frontend == "torch" else import_onnx)(model_cfg, source, tmp)
        write_manifest(tmp, "import", {"source": source}, {"model": model_cfg})
    print(done)


if __name__ == "__main__":
    run_stage(main)
