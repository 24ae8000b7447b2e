"""Tuned schedules for a step's kernels, as the tune stage gives the build (tune@<case>[-<device>]).

The profile's ``tune.trials`` decides how much tuning happens:
- 0 (every shipped profile): none; the committed records of device_profiles/tuned/<device>/
  that the step's kernels match are taken as they are, the way TVM's TopHub served pre-tuned
  schedules. `dvc repro` stays minutes, not hours.
- N > 0: N more trials of MetaSchedule, measured on this machine, starting from those committed
  records, so tuning only ever improves on them. Only kernels the build will generate are
  tuned (a product the backend measurement puts on OpenBLAS is not), and only the costliest
  ones, which together take ``TUNE_SHARE`` of the step's kernel time. A tuned schedule is kept
  only where it computes what the default one computes and measures faster by ``MARGIN``.
`pock pretuned <device>` then merges the results into the committed database.
"""
from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import tvm
from tvm import relax

from pipelines.backend.blas import MARGIN, measure, switch_backends
from pipelines.backend.cpu_schedules import tunable_kernels
from pipelines.backend.databases import (best_record, by_anchor_block, open_database,
                                         select_records)
from pipelines.backend.tuning import computes_the_same, kernel_us, tune
from pipelines.io import in_checkout

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


def step_kernels(mod: tvm.IRModule, backends: dict) -> tuple[dict, Counter]:
    """The kernels a CPU build of ``mod`` schedules, and how many times the step calls each.
    ``backends`` says which matrix products go on OpenBLAS (kernel -> "openblas")."""
    mod = switch_backends(mod, backends)
    return dict(tunable_kernels(mod)), calls_per_step(mod)


def by_cost(kernels: dict, calls: Counter, target) -> dict[str, float]:
    """Per kernel, microseconds per step with the default schedules (one call's time times its
    calls), costliest first."""
    cost = {name: kernel_us(func, target) * calls.get(name, 1) for name, func in kernels.items()}
    return dict(sorted(cost.items(), key=lambda item: -item[1]))


def tune_step(mod: tvm.IRModule, target, trials: int, cores: int, committed_dir: Path,
              out: Path, seed: int, label: str) -> dict:
    """Write to ``out`` a database with the best record of each of ``mod``'s kernels (the
    committed ones in ``committed_dir``, improved by ``trials`` of tuning); its metrics."""
    # Every product generated: the records a build may use whichever backend it measures.
    kernels, _ = step_kernels(mod, {})
    if target.kind.name != "llvm":  # GPU kernels take the GPU rules (backend/gpu.py)
        kernels = {}
    committed = open_database(committed_dir)
    metrics = {"kernels": len(kernels), "trials": trials if kernels else 0,
               "pretuned": in_checkout(committed_dir) if committed_dir.exists() else None}
    keep, sources = kernels, [committed]  # no trials: every committed record these match
    if trials and kernels:
        start = time.monotonic()
        generated, calls = step_kernels(mod, {name: row["backend"]
                                              for name, row in measure(mod, target).items()})
        print(f"{label}: timing {len(generated)} kernels with the default schedules", flush=True)
        cost = by_cost(generated, calls, target)
        total, covered, chosen = sum(cost.values()), 0.0, {}
        for name, us in cost.items():  # the costliest kernels that take TUNE_SHARE of the time
            if covered >= TUNE_SHARE * total:
                break
            chosen[name], covered = generated[name], covered + us
        with tempfile.TemporaryDirectory(prefix="pock-tune-") as work:
            print(f"{label}: {trials} trials over the {len(chosen)} kernels that take "
                  f"{covered / total:.0%} of {total / 1e3:.2f} ms of kernel time (logs: "
                  f"{work}/logs)", flush=True)
            tuned = tune(chosen, calls, target, trials, Path(work), [committed], seed, cores,
                         label)
            rows, keep, anchored = {}, {}, by_anchor_block([committed])
            for name, us in cost.items():
                row = {"calls": calls.get(name, 1),
                       "default_us": round(us / calls.get(name, 1), 3)}
                source = tuned if name in chosen else committed
                if best_record([source], generated[name]) is not None or (
                        source is committed
                        and best_record([anchored], generated[name]) is not None):
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
                tuned_trials_kernels=len(chosen),
                tuning_seconds=round(time.monotonic() - start, 1),
                kernel_ms_per_step={"default": round(total / 1e3, 3),
                                    "chosen": round(sum(per_step.values()) / 1e3, 3)},
                by_kernel=rows)
            metrics["trials_per_second"] = round(trials / metrics["tuning_seconds"], 3)
            found = select_records(keep, sources, out)
    else:
        found = select_records(keep, sources, out)
    metrics.update(tuned_kernels=len(found),
                   records_us={name: round(us, 3) for name, us in found.items()})
    return metrics
