"""lower: the imported model as Relax IR (``model.frontend``: a torch.export program, an ONNX
file, or a StableHLO program from JAX or Keras).

Outputs (artifacts/lower/):
  model.relax.py  TVMScript of main(x, *parameters, *buffers) -> (logits, *new_buffers)
  model.json      the same module, for the next stage
  params.npz      initial values of every parameter and buffer, by Relax name
  names.json      Relax name -> kind (parameter or buffer) and its name in the source model
                  ("torch": the PyTorch state-dict name, the ONNX initializer name, which for
                  a model exported from PyTorch is the same, the JAX tree path, or the Keras
                  variable path)
  origins.json    Relax binding name -> the layer it came from (PyTorch module or ONNX node)
"""
from __future__ import annotations

import numpy as np
import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, save_arrays, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.ir import save_ir

OUT = ARTIFACTS / "lower"
IMPORTED = ARTIFACTS / "import"


def lower_torch():
    import torch

    from stages.lower.translate import translate

    program = torch.export.load(IMPORTED / "model.pt2")
    func, names, origins = translate(program)
    state = program.state_dict | dict(program.named_buffers())
    values = {v.name: state[names[v.name][1]].detach().numpy() for v in func.params[1:]}
    return func, names, origins, values, IMPORTED / "model.pt2"


def lower_onnx():
    from stages.lower.from_onnx import initial_values, load_onnx, translate_onnx

    path = IMPORTED / "model.onnx"
    model = load_onnx(path)
    func, names, origins = translate_onnx(model, path)
    return func, names, origins, initial_values(model, names), path


def lower_stablehlo():
    import json

    from stages.lower.from_stablehlo import translate_stablehlo

    path = IMPORTED / "model.mlir"
    state = json.loads((IMPORTED / "state.json").read_text())
    with np.load(IMPORTED / "weights.npz") as weights:
        values = {name: weights[name] for name in weights.files}
    func, names, origins = translate_stablehlo(path.read_text(), state["parameters"], path,
                                               state["buffers"])
    return func, names, origins, {r: values[n] for r, (_, n) in names.items()}, path


def main() -> None:
    frontend = require(load_params(), "model.frontend")
    lower = {"torch": lower_torch, "onnx": lower_onnx, "jax": lower_stablehlo,
             "keras": lower_stablehlo}[frontend]
    func, names, origins, values, source = lower()
    ordered = [v.name for v in func.params[1:]]
    table = {name: {"kind": names[name][0], "torch": names[name][1]} for name in ordered}
    with atomic_dir(OUT) as tmp:
        save_ir(tvm.IRModule({"main": func}), tmp, "model")
        save_arrays(tmp / "params.npz", {name: values[name] for name in ordered})
        write_json_atomic(tmp / "names.json", table)
        write_json_atomic(tmp / "origins.json", origins)
        write_manifest(tmp, "lower", {"program": source}, {})
    print(f"lowered: {len(func.params) - 1} parameters and buffers")


if __name__ == "__main__":
    run_stage(main)
