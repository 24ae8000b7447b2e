"""schemes: every scheme in ``compare.schemes`` side by side with full backpropagation.

Per scheme (conf/sparse/<name>.yaml, and the scheme_search stage's artifacts/search/scheme.yaml)
on the host profile: what pruning removes (FLOPs of the
backward pass and updates, gradient, state and saved-activation bytes), the compiled step's
latency (a fresh process per case, the benchmark's loop) and the accuracy after fine-tuning
with the compiled step on the digits task (the finetune stage's data, epochs and batch order).
PyTorch eager with full backpropagation is timed in the same run for the ratios.
Output: artifacts/schemes/metrics.json (DVC metrics).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from pipelines.artifacts import ARTIFACTS, write_json_atomic
from pipelines.config import (load_conf_entry, load_params, resolved_profile, require, run_stage,
                              tvm_target)
from pipelines.ir import load_ir, nbytes
from pipelines.models import build_model
from pipelines.progress import progress
from pipelines.step import CompiledStep, load_initial, save_step
from pipelines.torch_ref import accuracy, batches
from pipelines.tuning import PRETUNED, open_databases
from stages.benchmark.__main__ import case_spec, run_isolated
from stages.optimize.passes import optimize
from stages.prune.__main__ import prune_scheme

AUTODIFF = ARTIFACTS / "autodiff"
LAYERS = ARTIFACTS / "import" / "layers.json"
OUT = ARTIFACTS / "schemes" / "metrics.json"
SEARCHED = ARTIFACTS / "search" / "scheme.yaml"


def finetune(build_dir: Path, params: dict) -> dict:
    """Fine-tune with the compiled step as the finetune stage does; accuracy and final loss."""
    data = np.load(ARTIFACTS / "data" / "digits.npz")
    x, y = data["finetune_train_x"], data["finetune_train_y"]
    model_cfg, seed = params["model"], int(params["seed"])
    step = CompiledStep(build_dir, load_initial(ARTIFACTS / "lower" / "params.npz"))
    losses = []
    for epoch in range(int(params["finetune"]["epochs"])):
        losses = [step.step(x[i], y[i])
                  for i in batches(len(x), int(model_cfg["batch_size"]), seed, epoch)]
    evaluator = build_model(model_cfg)
    evaluator.load_state_dict(torch.load(ARTIFACTS / "pretrain" / "weights.pt",
                                         weights_only=True))
    return {"accuracy": accuracy(step.load_into(evaluator), data["finetune_test_x"],
                                 data["finetune_test_y"]),
            "final_epoch_loss": float(np.mean(losses))}


def main() -> None:
    params = load_params()
    profile = resolved_profile("host")
    names = list(require(params, "compare.schemes"))
    # every name checked before any work
    schemes = [load_conf_entry("sparse", n, "compare.schemes") for n in names]
    schemes.append(yaml.safe_load(SEARCHED.read_text()))
    layers = json.loads(LAYERS.read_text())
    signature = json.loads((AUTODIFF / "signature.json").read_text())
    full = load_ir(AUTODIFF / "train_step.json")["train_step"]
    reorder = bool(require(params, "optimize.reorder_updates"))
    recomputed = require(params, "optimize.recompute") == "always"
    rows, spec = {}, case_spec(params, profile, {})
    # tune@host holds records for the host build's step only (the configured scheme); the
    # committed database also holds those of every scheme tuned before (full BP among them).
    tuned_host = open_databases([PRETUNED / "host", ARTIFACTS / "tune" / "host"])
    scratch = Path(tempfile.mkdtemp(prefix="pock-schemes-"))
    try:
        for scheme in progress(schemes, "schemes"):
            step, sig, summary = prune_scheme(scheme, layers, full, signature)
            directory = scratch / scheme["name"]
            directory.mkdir()
            save_step(optimize(step, sig, reorder, recomputed), sig, tvm_target(profile), directory,
                      database=tuned_host)
            timing = run_isolated("compiled", dict(spec, build_dir=str(directory)))
            tuned = finetune(directory, params)
            pruned, whole = summary["pruned"], summary["full"]
            rows[scheme["name"]] = {
                "median_ms": timing["median_ms"], **tuned,
                # What the step holds beyond its batch (the report's memory plot).
                "memory": {"weights_bytes": sum(nbytes(p) for p in
                                                step.params[2:2 + sig["num_params"]]),
                           **{k: pruned[k] for k in ("optimizer_state_bytes", "param_grad_bytes",
                                                     "saved_activation_bytes")}},
                "trainable_elements": pruned["trainable_elements"],
                "channel_sparse_parameters": len(summary["channel_sparse"]),
                **{f"{key}_vs_full": pruned[key] / whole[key] if whole[key] else None
                   for key in ("ops", "flops", "backward_flops", "param_grad_bytes",
                               "optimizer_state_bytes", "saved_activation_bytes")},
            }
            print(f"{scheme['name']}: {timing['median_ms']:.2f} ms/step, accuracy "
                  f"{tuned['accuracy']:.3f}, backward FLOPs "
                  f"{rows[scheme['name']]['backward_flops_vs_full']:.3f} of full", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    torch_full = run_isolated("torch_eager_full", spec)["median_ms"]
    full_ms = rows["full"]["median_ms"] if "full" in rows else None
    for row in rows.values():
        row["speedup_vs_torch_eager_full"] = torch_full / row["median_ms"]
        row["speedup_vs_compiled_full"] = full_ms / row["median_ms"] if full_ms else None
    write_json_atomic(OUT, {"model": params["model"]["name"], "torch_eager_full_ms": torch_full,
                            "order": [s["name"] for s in schemes], "schemes": rows})


if __name__ == "__main__":
    run_stage(main)
