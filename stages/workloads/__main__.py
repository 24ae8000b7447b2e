"""workloads: the text models' training steps against PyTorch on the host profile.

Usage: python -m stages.workloads
For each model of ``workloads.models`` (conf/model/<name>.yaml at its reference size: the
LLaMA-style decoder llama_tiny, the pretrained MiniLM encoder) and each of its schemes
(conf/sparse; a LoRA scheme's seeded adapters added to the model, and to PyTorch's with it):
import, autodiff, prune, optimize and build the step here
(matrix products on the backend measured faster, as build@host does), check its first step's
loss against PyTorch's, then time it as the benchmark does (a fresh process per case, the
profile's cores, ``benchmark.warmup`` then ``benchmark.steps`` steps). In the same run: PyTorch
eager full backpropagation, eager with the scheme's frozen layers frozen, and `torch.compile`d
full backpropagation.

A model starts from its weights (seeded random for llama_tiny; MiniLM's pretrained encoder with
a seeded head) and trains on one batch of seeded random tokens and labels (synthetic: this
stage measures speed and memory, not quality).
Output: artifacts/workloads/metrics.json (DVC metrics): per model and scheme, ms per step,
tokens/s, GFLOP/s, peak memory, the ratios to each PyTorch case, and which backend each product
took.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipelines.artifacts import ARTIFACTS, save_arrays, write_json_atomic
from pipelines.config import (ConfigError, load_conf_entry, load_params, require,
                              resolved_profile, run_stage, tvm_target)
from pipelines.lora import adapted, add_adapters
from pipelines.models import build_model
from pipelines.progress import progress
from pipelines.step import CompiledStep, initial_from, save_step, selection_of
from pipelines.tuning import open_database
from stages.benchmark.__main__ import in_fresh_process, run_isolated
from stages.benchmark.cases import sgemm_peak
from stages.optimize.passes import optimize
from stages.prune.__main__ import all_trainable, step_cost
from stages.prune.show import scheme_step, shared_full_step

OUT = ARTIFACTS / "workloads" / "metrics.json"
DEVICE = "host"  # the profile these steps are built on and timed with
TUNED = ARTIFACTS / "tune_workloads"  # the tune_workloads stage's database
# The compiled step's losses against PyTorch's over the first steps (the second one's loss
# reads the first one's update), same weights and tokens.
CHECKED_STEPS, LOSS_RTOL = 2, 1e-4


TEXT_ARCHS = {"llama", "minilm"}


def load_model(name: str) -> dict:
    model = load_conf_entry("model", name, "workloads.models")
    if model.get("arch") not in TEXT_ARCHS:
        raise ConfigError(f"params.yaml: workloads.models names {name!r}, a {model.get('arch')} "
                          f"model; this stage measures text models (arch {sorted(TEXT_ARCHS)})")
    return model


def configured(params: dict) -> list[tuple[dict, list[dict]]]:
    """workloads.models as (model, its schemes) pairs, every name checked before any work."""
    wanted = require(params, "workloads.models")
    if not isinstance(wanted, dict) or not wanted:
        raise ConfigError("params.yaml: workloads.models must map model names to lists of "
                          "schemes, e.g. {llama_tiny: [full, transformer_paper]}")
    return [(load_model(name), [load_conf_entry("sparse", s, f"workloads.models.{name}")
                                for s in schemes]) for name, schemes in wanted.items()]


def optimized_step(model: dict, optimizer: dict, scheme: dict, seed: int, full_steps: dict):
    """The scheme's step of ``model`` as this stage builds it, with its signature and the
    pruning summary (``full_steps``: the full steps schemes of one model share)."""
    step, signature, summary = scheme_step(model, optimizer, scheme, seed, full_steps)
    return optimize(step, signature, reorder=True), signature, summary


def main() -> None:
    params = load_params()
    profile = resolved_profile(DEVICE)
    workloads = configured(params)
    if not TUNED.is_dir():
        raise ConfigError(f"{TUNED}: not found; run `dvc repro tune_workloads` first")
    database = open_database(TUNED)
    # The yardstick for GFLOP/s, measured once for every model.
    peak = in_fresh_process(sgemm_peak, int(profile["cores"]))
    metrics = {model["name"]: measure(model, schemes, params, profile, peak, database)
               for model, schemes in workloads}
    write_json_atomic(OUT, metrics)
    for model, rows in metrics.items():
        eager = rows["torch_eager_full"]
        for name, row in rows["schemes"].items():
            print(f"{model} {name}: {row['compiled']['tokens_per_s']:.0f} tokens/s; "
                  f"{row['speedup_vs_torch_eager_full']:.2f}x PyTorch eager full BP "
                  f"({eager['tokens_per_s']:.0f} tokens/s), "
                  f"{row['speedup_vs_torch_eager_frozen']:.2f}x eager with the same layers "
                  f"frozen, {row['speedup_vs_torch_compile_full']:.2f}x torch.compile full BP")


def synthetic_batch(model: dict, net: torch.nn.Module, seed: int):
    """Seeded random token ids and labels: next tokens for a decoder (one per position),
    classes for an encoder with a classification head (one per sequence)."""
    rng = np.random.default_rng(seed)
    vocab = next(m for m in net.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    batch, seq = int(model["batch_size"]), int(model["seq_len"])
    x = rng.integers(0, vocab, (batch, seq))
    y = (rng.integers(0, vocab, batch * seq) if model["arch"] == "llama"
         else rng.integers(0, int(model["num_classes"]), batch))
    return x, y


def measure(model: dict, schemes: list[dict], params: dict, profile: dict, peak: float,
            database) -> dict:
    """One model's rows: its compiled step per scheme (kernels with a record in ``database``
    on their tuned schedule) and the PyTorch cases, timed."""
    optimizer, seed = require(params, "optimizer"), int(params["seed"])
    bench = require(params, "benchmark")
    tokens = int(model["batch_size"]) * int(model["seq_len"])
    scratch = Path(tempfile.mkdtemp(prefix="pock-workloads-"))
    try:
        torch.manual_seed(seed)
        net = build_model(model).train()
        torch.save(net.state_dict(), scratch / "weights.pt")
        x, y = synthetic_batch(model, net, seed)
        save_arrays(scratch / "batch.npz", {"x": x, "y": y})
        spec = {"cores": int(profile["cores"]), "batch": int(model["batch_size"]),
                "warmup": int(bench["warmup"]), "steps": int(bench["steps"]),
                "batch_file": str(scratch / "batch.npz"), "weights": str(scratch / "weights.pt"),
                "model": model, "optimizer": optimizer, "trainable": {}}
        full_steps, rows = {}, {}
        for scheme in progress(schemes, f"workloads {model['name']}"):
            lora = scheme.get("lora")
            step, sig, summary = optimized_step(model, optimizer, scheme, seed, full_steps)
            directory = scratch / scheme["name"]
            directory.mkdir()
            initial = directory.with_suffix(".initial.npz")
            save_arrays(initial, initial_from(adapted(net, lora, seed), sig))
            scheme_spec = dict(spec, initial=str(initial), lora=lora, seed=seed)
            started = time.perf_counter()
            backends, schedules = save_step(step, sig, tvm_target(profile), directory,
                                            measured_backends=True, database=database)
            build_s = time.perf_counter() - started
            frozen = dict(scheme_spec, trainable=selection_of(sig))
            compiled_step = CompiledStep(directory, dict(np.load(initial)))
            compiled_loss = [compiled_step.step(x, y) for _ in range(CHECKED_STEPS)]
            torch_loss = torch_losses(model, optimizer, frozen, x, y)
            if not np.allclose(compiled_loss, torch_loss, rtol=LOSS_RTOL, atol=0):
                raise SystemExit(f"error: {model['name']} {scheme['name']}: the compiled "
                                 f"step's losses {compiled_loss} are not PyTorch's "
                                 f"{torch_loss} (rtol {LOSS_RTOL})")
            rows[scheme["name"]] = {
                "compiled": run_isolated("compiled", dict(scheme_spec,
                                                          build_dir=str(directory))),
                "torch_eager_frozen": run_isolated("torch_eager_frozen", frozen),
                "flops": summary["pruned"]["flops"], "build_s": build_s,
                "loss_compiled": compiled_loss, "loss_torch": torch_loss,
                "backends": dict(Counter(r["backend"] for r in backends.values())),
                "tuned_kernels": schedules["tuned"],
            }
            print(f"{model['name']} {scheme['name']}: compiled "
                  f"{rows[scheme['name']]['compiled']['median_ms']:.1f} ms/step; products "
                  f"{rows[scheme['name']]['backends']}; {schedules['tuned']} kernels on tuned "
                  f"schedules", flush=True)
        eager = run_isolated("torch_eager_full", spec)
        compiled_torch = run_isolated("torch_compile_full", spec)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    # The PyTorch full-BP cases run the model without adapters: its full step's FLOPs.
    _, full, signature = shared_full_step(model, optimizer, None, seed, full_steps)
    full_flops = step_cost(full, all_trainable(signature))["flops"]
    for case, flops in ((eager, full_flops), (compiled_torch, full_flops)):
        case.update(tokens_per_s=tokens / case["median_ms"] * 1e3,
                    gflop_per_s=flops / case["median_ms"] / 1e6)
    for row in rows.values():
        for case in (row["compiled"], row["torch_eager_frozen"]):
            case.update(tokens_per_s=tokens / case["median_ms"] * 1e3,
                        gflop_per_s=row["flops"] / case["median_ms"] / 1e6)
        ms = row["compiled"]["median_ms"]
        row["compiled"]["fraction_of_sgemm_peak"] = row["compiled"]["gflop_per_s"] / peak
        row.update(
            speedup_vs_torch_eager_full=eager["median_ms"] / ms,
            speedup_vs_torch_eager_frozen=row["torch_eager_frozen"]["median_ms"] / ms,
            speedup_vs_torch_compile_full=compiled_torch["median_ms"] / ms,
            memory_ratio_vs_torch_eager_full=(row["compiled"]["peak_rss_bytes"]
                                              / eager["peak_rss_bytes"]
                                              if eager["peak_rss_bytes"] else None))
    return {"tokens_per_step": tokens, "data": "synthetic: seeded random tokens and labels",
            "sgemm_peak_gflop_per_s": peak, "torch_eager_full": eager,
            "torch_compile_full": compiled_torch, "schemes": rows}


def torch_losses(model: dict, optimizer: dict, spec: dict, x, y) -> list[float]:
    from pipelines.torch_ref import make_optimizer, train_step

    net = build_model(model).train()
    net.load_state_dict(torch.load(spec["weights"], weights_only=True))
    if spec.get("lora"):
        add_adapters(net, spec["lora"], spec["seed"])
    update = make_optimizer(net, optimizer, spec["trainable"])
    return [train_step(net, update, torch.from_numpy(x), torch.from_numpy(y))
            for _ in range(CHECKED_STEPS)]


if __name__ == "__main__":
    run_stage(main)
