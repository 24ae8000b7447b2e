"""lower: the exported program as Relax IR.

Outputs (artifacts/lower/):
  model.relax.py  TVMScript of main(x, *parameters, *buffers) -> (logits, *new_buffers)
  model.json      the same module, for the next stage
  params.npz      initial values of every parameter and buffer, by Relax name
  names.json      Relax name -> PyTorch state-dict name and kind (parameter or buffer)
  origins.json    Relax binding name -> the PyTorch module it came from
"""
from __future__ import annotations

import torch
import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, save_arrays, write_json_atomic, write_manifest
from pipelines.config import run_stage
from pipelines.ir import save_ir
from stages.lower.translate import translate

OUT = ARTIFACTS / "lower"
PROGRAM = ARTIFACTS / "import" / "model.pt2"


def main() -> None:
    program = torch.export.load(PROGRAM)
    func, names, origins = translate(program)
    state = program.state_dict | dict(program.named_buffers())
    ordered = [v.name for v in func.params[1:]]
    values = {name: state[names[name][1]].detach().numpy() for name in ordered}
    table = {name: {"kind": names[name][0], "torch": names[name][1]} for name in ordered}
    with atomic_dir(OUT) as tmp:
        save_ir(tvm.IRModule({"main": func}), tmp, "model")
        save_arrays(tmp / "params.npz", values)
        write_json_atomic(tmp / "names.json", table)
        write_json_atomic(tmp / "origins.json", origins)
        write_manifest(tmp, "lower", {"program": PROGRAM}, {})
    print(f"lowered: {len(func.params) - 1} parameters and buffers")


if __name__ == "__main__":
    run_stage(main)
