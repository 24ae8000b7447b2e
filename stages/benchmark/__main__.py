"""benchmark@device: run the device's build where its profile's runner reaches it.

Usage: python -m stages.benchmark <device>
Output: artifacts/benchmark/<device>.json (DVC metrics), by runner:
- local: the compiled step against PyTorch on the same shapes, in one run: per case the median
  and p90 step time over ``benchmark.steps`` steps after ``benchmark.warmup``, peak resident
  memory above the process baseline, and the ratios compiled vs PyTorch;
- rpc / emulated / docker: one step on the device (a TVM RPC server; qemu user mode; a
  container limited to the profile's cores and memory) checked against the host build's step
  on the same arguments (loss and every updated tensor), then step times: measured on the
  device by TVM's time_evaluator (rpc), or labelled ``emulated`` or ``container`` (this
  machine's cores, not the device's; never compared with real timings). ``verdict`` is ``ok``,
  or ``out_of_memory`` when the step did not fit in the container's memory_mb: recorded, and
  the stage succeeds (the device's answer, not a crash of the pipeline);
- none: nothing here reaches the device; says so, and why.
"""
from __future__ import annotations

import json
import multiprocessing
import sys

from pipelines.artifacts import ARTIFACTS, write_json_atomic
from pipelines.config import load_params, require, resolved_profile, run_stage
from pipelines.progress import progress
from pipelines.step import selection_of
from stages.benchmark.cases import run_case, sgemm_peak

CASES = ["compiled", "torch_eager_full", "torch_eager_frozen", "torch_compile_full"]
# Which step's FLOPs each case computes (artifacts/prune/report.json): the compiled step and
# PyTorch with frozen layers do the sparse step's work, the others all of full BP.
WORK = {"compiled": "pruned", "torch_eager_frozen": "pruned", "torch_eager_full": "full",
        "torch_compile_full": "full"}


def in_fresh_process(function, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def run_isolated(case: str, spec: dict) -> dict:
    """Each case in a fresh process so memory peaks and thread pools do not mix."""
    return in_fresh_process(run_case, case, spec)


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


# A device's step must match the host build's to this tolerance (different CPUs and vector
# widths sum in different orders).
RTOL, ATOL = 1e-4, 1e-5


def remote(device: str, params: dict, profile: dict) -> dict:
    """One step on the device, checked against the host build's; then step times there."""
    import numpy as np

    from pipelines.step import CompiledStep, load_initial
    from stages.benchmark.cases import first_batch
    from pipelines.images import OutOfMemory
    from stages.benchmark.remote import run_docker, run_emulated, run_rpc

    build_dir, runner = ARTIFACTS / "build" / device, profile["runner"]
    built = json.loads((build_dir / "manifest.json").read_text())["params"]
    spec = case_spec(params, profile, {})
    host = CompiledStep(ARTIFACTS / "build" / "host", load_initial(spec["initial"]))
    args = host.arguments(*first_batch(spec["data"], spec["batch"]))
    want = [o.numpy() for o in host.function(*args)]
    run = {"rpc": run_rpc, "emulated": run_emulated, "docker": run_docker}[runner]
    try:
        got, times, info = run(build_dir / built["library"], [a.numpy() for a in args],
                               profile, spec["warmup"], spec["steps"])
    except OutOfMemory as err:
        return {"verdict": "out_of_memory", "memory_mb": profile["memory_mb"],
                "reason": str(err).splitlines()[0]}
    worst = max(float(np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w))))
                for g, w in zip(got, want))
    timing = {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
              "steps": len(times)}
    return {
        "verdict": "ok", **info, "loss": float(got[0]), "loss_host": float(want[0]),
        # <= 1: every output within rtol 1e-4, atol 1e-5 of the host build's
        "matches_host": len(got) == len(want) and worst <= 1.0,
        "worst_diff_over_tolerance": worst,
        # Emulated time is qemu's and container time this machine's, not the device's: kept
        # apart from real timings.
        {"emulated": "emulated", "docker": "container"}.get(runner, "compiled"): timing,
    }


def benchmark(device: str) -> dict:
    params = load_params()
    profile = resolved_profile(device)
    build_dir = ARTIFACTS / "build" / device
    signature = json.loads((build_dir / "signature.json").read_text())
    head = {"device": device, "scheme": signature["scheme"], "model": params["model"]["name"],
            "runner": profile["runner"]}
    if profile["runner"] == "none":
        built = json.loads((build_dir / "manifest.json").read_text())["params"]
        return {**head, "ran": False, "reason": (
            "runner none: nothing here reaches the device" + (
                "; the archive is linked on the device" if built["links_on_device"] else "")
            + f"; to run it, start `python -m tvm.exec.rpc_server --tracker HOST:PORT --key "
              f"KEY` there and set +profiles.{device}.runner=rpc")}
    if profile["runner"] != "local":
        return {**head, "ran": True, **remote(device, params, profile)}
    spec = case_spec(params, profile, selection_of(signature))
    spec["build_dir"] = str(build_dir)
    results = {case: run_isolated(case, spec) for case in progress(CASES, f"benchmark {device}")}
    plan = json.loads((build_dir / "plan.json").read_text())
    compiled = results["compiled"]
    compiled["planned_peak_bytes"] = plan["planned_peak_bytes"]
    compiled["recomputed"] = plan["recomputed"]
    compiled["images_per_s"] = spec["batch"] / compiled["median_ms"] * 1e3
    flops = json.loads((ARTIFACTS / "prune" / "report.json").read_text())
    peak = in_fresh_process(sgemm_peak, spec["cores"])
    for case, row in results.items():
        row["gflop_per_s"] = flops[WORK[case]]["flops"] / row["median_ms"] / 1e6
        row["fraction_of_sgemm_peak"] = row["gflop_per_s"] / peak
    return {
        **head, "ran": True, **results,
        "sgemm_peak_gflop_per_s": peak,
        "speedup_vs_torch_compile_full":
            results["torch_compile_full"]["median_ms"] / compiled["median_ms"],
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
    print(summary(metrics))
    if metrics.get("matches_host") is False:  # recorded, and the stage fails: a wrong build
        sys.exit(f"error: {device}'s step does not match the host build's (worst output "
                 f"{metrics['worst_diff_over_tolerance']:.1f}x over rtol {RTOL}, atol {ATOL})")


def summary(metrics: dict) -> str:
    """One line per device: what ran where and how it compares."""
    device = f"{metrics['device']} ({metrics['model']}, {metrics['scheme']})"
    if not metrics["ran"]:
        return f"{device}: not run ({metrics['reason']})"
    if metrics["runner"] == "local":
        return (f"{device}: compiled {metrics['compiled']['median_ms']:.2f} ms/step; "
                f"{metrics['speedup_vs_torch_eager_full']:.2f}x PyTorch eager full BP, "
                f"{metrics['speedup_vs_torch_eager_frozen']:.2f}x eager with the same layers "
                f"frozen, {metrics['speedup_vs_torch_compile_full']:.2f}x torch.compile full BP; "
                f"{metrics['compiled']['gflop_per_s']:.2f} GFLOP/s "
                f"({metrics['compiled']['fraction_of_sgemm_peak']:.1%} of sgemm's "
                f"{metrics['sgemm_peak_gflop_per_s']:.0f})")
    if metrics["verdict"] == "out_of_memory":
        return f"{device}: {metrics['runner']}, OUT OF MEMORY ({metrics['reason']})"
    label = next(k for k in ("compiled", "emulated", "container") if k in metrics)
    return (f"{device}: {metrics['runner']}, loss {metrics['loss']:.6f} "
            f"{'matches' if metrics['matches_host'] else 'DOES NOT MATCH'} the host build's "
            f"{metrics['loss_host']:.6f}; {metrics[label]['median_ms']:.2f} ms/step"
            + {"compiled": "", "emulated": " (emulated, not the device's speed)",
               "container": " (in a container on this machine's cores)"}[label])


if __name__ == "__main__":
    run_stage(main)
