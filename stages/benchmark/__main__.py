"""benchmark@device: time the compiled step against PyTorch on the same shapes, in one run.

Usage: python -m stages.benchmark <device>
Output: artifacts/benchmark/<device>.json (DVC metrics): per case the median and p90 step time
over ``benchmark.steps`` steps after ``benchmark.warmup``, peak resident memory above the
process baseline, and the ratios compiled vs PyTorch.
"""
from __future__ import annotations

import json
import multiprocessing
import sys

from pipelines.artifacts import ARTIFACTS, write_json_atomic
from pipelines.config import ConfigError, load_params, load_profile, require, run_stage
from pipelines.progress import progress
from pipelines.step import selection_of
from stages.benchmark.cases import run_case

CASES = ["compiled", "torch_eager_full", "torch_eager_frozen"]


def run_isolated(case: str, spec: dict) -> dict:
    """Each case in a fresh process so memory peaks and thread pools do not mix."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_case, (case, spec))


def case_spec(params: dict, profile: dict, trainable: dict) -> dict:
    """What every case needs (stages/benchmark/cases.py); ``trainable`` is the scheme's
    selection (PyTorch name -> None or channels) the frozen-layers case trains. The compiled
    case also needs ``build_dir``."""
    bench, model_cfg = require(params, "benchmark"), require(params, "model")
    return {
        "cores": int(profile["cores"]), "batch": int(model_cfg["batch_size"]),
        "warmup": int(bench["warmup"]), "steps": int(bench["steps"]),
        "data": str(ARTIFACTS / "data" / "digits.npz"),
        "initial": str(ARTIFACTS / "lower" / "params.npz"),
        "weights": str(ARTIFACTS / "pretrain" / "weights.pt"), "model": model_cfg,
        "optimizer": require(params, "optimizer"), "trainable": trainable,
    }


def benchmark(device: str) -> dict:
    params = load_params()
    profile = load_profile(device)
    if profile["runner"] != "local":
        raise ConfigError(f"device_profiles/{device}.yaml: runner={profile['runner']!r} "
                          "is not available yet; allowed: ['local']")
    build_dir = ARTIFACTS / "build" / device
    signature = json.loads((build_dir / "signature.json").read_text())
    model_cfg = require(params, "model")
    spec = case_spec(params, profile, selection_of(signature))
    spec["build_dir"] = str(build_dir)
    results = {case: run_isolated(case, spec) for case in progress(CASES, f"benchmark {device}")}
    plan = json.loads((build_dir / "plan.json").read_text())
    compiled = results["compiled"]
    compiled["planned_peak_bytes"] = plan["planned_peak_bytes"]
    compiled["recomputed"] = plan["recomputed"]
    compiled["images_per_s"] = spec["batch"] / compiled["median_ms"] * 1e3
    return {
        "device": device, "scheme": signature["scheme"], "model": model_cfg["name"],
        **results,
        "speedup_vs_torch_eager_full":
            results["torch_eager_full"]["median_ms"] / compiled["median_ms"],
        "speedup_vs_torch_eager_frozen":
            results["torch_eager_frozen"]["median_ms"] / compiled["median_ms"],
        # null when PyTorch's peak did not rise above its baseline (nothing to divide by)
        "memory_ratio_vs_torch_eager_full":
            compiled["peak_rss_bytes"] / results["torch_eager_full"]["peak_rss_bytes"]
            if results["torch_eager_full"]["peak_rss_bytes"] else None,
    }


def main() -> None:
    device = sys.argv[1]
    metrics = benchmark(device)
    write_json_atomic(ARTIFACTS / "benchmark" / f"{device}.json", metrics)
    print(f"{device}: compiled {metrics['compiled']['median_ms']:.2f} ms/step; "
          f"{metrics['speedup_vs_torch_eager_full']:.2f}x vs PyTorch eager full BP, "
          f"{metrics['speedup_vs_torch_eager_frozen']:.2f}x vs eager with the same layers frozen")


if __name__ == "__main__":
    run_stage(main)
