"""import: the reference model, with pre-trained weights, through torch.export.

Outputs (artifacts/import/):
  model.pt2    the exported program (training mode: batch norm uses batch statistics)
  model.onnx   the same model as ONNX, the interchange format (inference mode)
  layers.json  every parameter with its module path, layer kind and block: what schemes select
"""
from __future__ import annotations

import io

import torch

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.models import build_model, example_input
from stages.importer.layers import describe_layers

OUT = ARTIFACTS / "import"
WEIGHTS = ARTIFACTS / "pretrain" / "weights.pt"


def main() -> None:
    params = load_params()
    model_cfg = require(params, "model")
    model = build_model(model_cfg)
    model.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    x = example_input(model_cfg)
    program = torch.export.export(model.train(), (x,))
    onnx_bytes = io.BytesIO()
    torch.onnx.export(model.eval(), (x,), onnx_bytes, dynamo=False, input_names=["x"],
                      output_names=["logits"], do_constant_folding=False)
    with atomic_dir(OUT) as tmp:
        torch.export.save(program, tmp / "model.pt2")
        (tmp / "model.onnx").write_bytes(onnx_bytes.getvalue())
        write_json_atomic(tmp / "layers.json", describe_layers(model))
        write_manifest(tmp, "import", {"weights": WEIGHTS}, {"model": model_cfg})
    print(f"exported {model_cfg['arch']}: {len(program.graph.nodes)} graph nodes")


if __name__ == "__main__":
    run_stage(main)
