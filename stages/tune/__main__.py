"""tune@device and tune_workloads: tuned schedules for the training steps' kernels.

Usage: python -m stages.tune <device>      the device's step (the one build@<device> builds)
       python -m stages.tune --workloads   the workloads stage's steps (workloads.models, every
                                           scheme; built on the host profile)
Outputs (artifacts/tune/<device>/, artifacts/tune_workloads/): workloads.json and records.json,
a MetaSchedule JSON database with the best schedule of each kernel that has one (the build
applies it: pipelines/tuning.py); metrics.json (kernels, how many have a tuned schedule; after
tuning, per kernel its default and tuned times and whether the tuned one computes the same, and
trials per second); manifest.json.

The profile's ``tune.trials`` (the host's for the workloads) decides how much tuning happens:
- 0 (every shipped profile): none; the committed records in device_profiles/tuned/<device>/
  that the steps' kernels match are taken as they are. `dvc repro` stays minutes, not hours.
- N > 0: N more trials of MetaSchedule, measured on this machine, starting from those committed
  records, so tuning only ever improves on them; e.g.
  `pock compose +profiles.host.tune.trials=2000 && dvc repro tune@host tune_workloads`.
  Only kernels the build will generate are tuned: a matrix product the backend measurement
  puts on OpenBLAS is not. `pock pretuned host` then merges the results into the committed
  database.
"""
from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import tvm
from tvm import relax

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_manifest
from pipelines.backends import MARGIN, measure, switch_backends
from pipelines.config import load_params, require, resolved_profile, run_stage, tvm_target
from pipelines.ir import load_ir
from stages.build.__main__ import step_to_build
from stages.workloads.__main__ import DEVICE as WORKLOADS_DEVICE
from pipelines.tuning import (PRETUNED, best_record, computes_the_same, kernel_us,
                              open_database, select_records, tunable_kernels, tune)

TUNE_SHARE = 0.9  # of the step's kernel time (default schedules) that is tuned


def calls_per_step(mod) -> Counter:
    """How many times the step calls each kernel: MetaSchedule's task weights."""
    calls = Counter()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: calls.update(
                [e.args[0].name_hint]) if isinstance(e, relax.Call) and getattr(
                    e.op, "name", "") == "relax.call_tir" else None)
    return calls


def device_steps(profile: dict) -> tuple[dict[str, tvm.IRModule], dict]:
    """The step the device's build will compile (the recomputing twin where the plain one is
    over budget), by name, and the files it comes from."""
    _, _, path = step_to_build(profile)
    return {"": load_ir(path)}, {"step": path}


def workload_steps(params: dict) -> tuple[dict[str, tvm.IRModule], dict]:
    """The workloads stage's steps (every model and scheme of workloads.models, built as that
    stage builds them), by "<model>.<scheme>"."""
    from stages.workloads.__main__ import configured, optimized_step

    optimizer, seed, steps = require(params, "optimizer"), int(params["seed"]), {}
    for model, schemes in configured(params):
        full_steps = {}
        for scheme in schemes:
            steps[f"{model['name']}.{scheme['name']}"], _, _ = optimized_step(
                model, optimizer, scheme, seed, full_steps)
    return steps, {"models": Path("conf/model"), "schemes": Path("conf/sparse")}


def step_kernels(steps: dict[str, tvm.IRModule], backends) -> tuple[dict, Counter]:
    """The kernels a CPU build of ``steps`` schedules, named "<step>.<kernel>" where there
    are several steps, and how many times a step calls each. ``backends(mod)`` says which
    matrix products go on OpenBLAS (kernel -> "openblas"); the others stay generated."""
    kernels, calls = {}, Counter()
    for prefix, mod in steps.items():
        mod = switch_backends(mod, backends(mod))
        prefix = f"{prefix}." if prefix else ""
        kernels.update({prefix + name: func for name, func in tunable_kernels(mod).items()})
        calls.update({prefix + name: count for name, count in calls_per_step(mod).items()})
    return kernels, calls


def by_cost(kernels: dict, calls: Counter, target) -> dict[str, float]:
    """Per kernel, microseconds per step with the default schedules (one call's time times its
    calls), costliest first."""
    cost = {name: kernel_us(func, target) * calls.get(name, 1) for name, func in kernels.items()}
    return dict(sorted(cost.items(), key=lambda item: -item[1]))


def main(device: str | None) -> None:
    """Tune ``device``'s step, or with None the workloads' steps on the host profile."""
    params = load_params()
    profile = resolved_profile(device or WORKLOADS_DEVICE)
    trials, target = profile["tune"]["trials"], tvm_target(profile)
    label = f"tune@{device}" if device else "tune_workloads"
    out = ARTIFACTS / "tune" / device if device else ARTIFACTS / "tune_workloads"
    pretuned = PRETUNED / profile["name"]
    steps, inputs = device_steps(profile) if device else workload_steps(params)
    # Every product generated: the records a build may use whichever backend it measures.
    kernels, _ = step_kernels(steps, lambda mod: {})
    if target.kind.name != "llvm":  # GPU kernels take the GPU rules (stages/build/gpu.py)
        kernels = {}
    committed = open_database(pretuned)
    metrics = {"kernels": len(kernels), "trials": trials if kernels else 0,
               "pretuned": str(pretuned) if pretuned.exists() else None}
    with atomic_dir(out) as tmp, tempfile.TemporaryDirectory(prefix="pock-tune-") as work:
        keep = kernels  # with no trials, every committed record these kernels match
        sources = [committed]
        if trials and kernels:
            start = time.monotonic()
            # What the build will generate: the products OpenBLAS measures faster on are not
            # worth a trial.
            generated, calls = step_kernels(steps, lambda mod: {
                name: row["backend"] for name, row in measure(mod, target).items()})
            print(f"{label}: timing {len(generated)} kernels with the default schedules",
                  flush=True)
            cost = by_cost(generated, calls, target)
            # The costliest kernels that together take TUNE_SHARE of the kernel time: the
            # rest are too cheap to repay a round of trials each.
            total, covered, chosen = sum(cost.values()), 0.0, {}
            for name, us in cost.items():
                if covered >= TUNE_SHARE * total:
                    break
                chosen[name], covered = generated[name], covered + us
            print(f"{label}: {trials} trials over the {len(chosen)} kernels that take "
                  f"{covered / total:.0%} of {total / 1e3:.2f} ms of kernel time "
                  f"(logs: {work}/logs)", flush=True)
            tuned = tune(chosen, calls, target, trials, Path(work), [committed],
                         params["seed"], profile["cores"], label)
            # A tuned schedule (this run's, or for a kernel left out of it the committed one)
            # is kept only where it computes what the default one computes and measures faster.
            rows, keep = {}, {}
            for name, us in cost.items():
                row = {"calls": calls.get(name, 1), "default_us": round(us / calls.get(name, 1), 3)}
                source = tuned if name in chosen else committed
                if best_record([source], generated[name]) is not None:
                    row["tuned_us"] = round(kernel_us(generated[name], target, source), 3)
                    row["same_results"] = computes_the_same(generated[name], target, source)
                    if row["same_results"] and row["tuned_us"] * MARGIN < row["default_us"]:
                        keep[name] = generated[name]
                row["schedule"] = "tuned" if name in keep else "default"
                rows[name] = row
            sources = [tuned, committed]
            per_step = {name: row["calls"] * (row["tuned_us"] if name in keep else
                                              row["default_us"]) for name, row in rows.items()}
            metrics.update(
                tuned_trials_kernels=len(chosen), tuning_seconds=round(time.monotonic() - start, 1),
                kernel_ms_per_step={"default": round(total / 1e3, 3),
                                    "chosen": round(sum(per_step.values()) / 1e3, 3)},
                by_kernel=rows)
            metrics["trials_per_second"] = round(trials / metrics["tuning_seconds"], 3)
        found = select_records(keep, sources, tmp)
        metrics.update(tuned_kernels=len(found),
                       records_us={name: round(us, 3) for name, us in found.items()})
        write_json_atomic(tmp / "metrics.json", metrics)
        inputs.update({"pretuned": pretuned} if pretuned.exists() else {})
        write_manifest(tmp, label, inputs, {"profile": profile, "trials": trials,
                                            **({} if device else {"steps": list(steps)})})
    print(f"{label}: {len(found)} of {len(kernels)} kernels have a tuned schedule"
          + (f"; {trials} trials in {metrics['tuning_seconds']:.0f} s" if trials and kernels
             else f" (tune.trials is 0: the records committed in {pretuned})" if pretuned.exists()
             else f" (tune.trials is 0 and {pretuned} holds no records)"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stages.tune <device> | --workloads")
    run_stage(lambda: main(None if sys.argv[1] == "--workloads" else sys.argv[1]))
