"""autodiff: loss + reverse-mode gradient + optimizer update, one Relax function.

Outputs (artifacts/autodiff/):
  train_step.relax.py / .json  the full-backprop training step (every parameter updated)
  signature.json               its inputs and outputs in order, with PyTorch names
"""
from __future__ import annotations

import json

import tvm

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.config import load_params, require, run_stage
from pipelines.ir import load_ir, save_ir
from stages.autodiff import optimizers
from stages.autodiff.training import MissingGradientRule, build_train_step

OUT = ARTIFACTS / "autodiff"
LOWER = ARTIFACTS / "lower"


def main() -> None:
    params = load_params()
    opt_cfg = require(params, "optimizer")
    names = json.loads((LOWER / "names.json").read_text())
    num_params = sum(1 for v in names.values() if v["kind"] == "parameter")
    origins = json.loads((LOWER / "origins.json").read_text())
    main_fn = load_ir(LOWER / "model.json")["main"]
    try:
        step, signature = build_train_step(main_fn, num_params, optimizers.from_config(opt_cfg),
                                           origins)
    except MissingGradientRule as err:
        raise SystemExit(f"autodiff: {err}") from err
    signature["torch_names"] = {n: v["torch"] for n, v in names.items()}
    signature["num_params"] = num_params
    with atomic_dir(OUT) as tmp:
        save_ir(tvm.IRModule({"train_step": step}), tmp, "train_step")
        write_json_atomic(tmp / "signature.json", signature)
        write_manifest(tmp, "autodiff", {"lower": LOWER / "model.json"}, {"optimizer": opt_cfg})
    print(f"autodiff: train_step with {len(signature['inputs'])} inputs, "
          f"{len(signature['outputs'])} outputs")


if __name__ == "__main__":
    run_stage(main)
