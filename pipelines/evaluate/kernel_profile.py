"""Where a host build's step spends its time, kernel by kernel (profile@<case>).

The native runner (runtime/native_runner.cc, ``--profile``) runs the step with a VM instrument
written in C++ that times every call the VM makes (each compiled kernel, and the VM's own
builtins), ``benchmark.warmup`` + ``benchmark.steps`` steps, the first not counted; a second run
without it gives the plain step. Timed from Python, each call carried microseconds of the
callback, and the VM's small builtins read several times their cost. Each call is put in a
phase by its place in the step and its role:
- forward: the calls up to the loss (the first ``nll_loss`` kernel; the fused one,
  ``softmax_nll_loss``, also computes the logits' gradient, and counts here);
- update: calls after the loss whose result is a new parameter or optimizer state (the step's
  outputs, as the build recorded them: analysis/liveness.py, update_kernels; batch norm's
  running statistics are new state too, but computed before the loss, so forward);
- backward: the other calls after the loss.
and in a kind by the operator its kernel name starts with (conv2d, its transpose, matmul,
batch norm, reductions, elementwise, VM builtins).
The result: per phase and per kind, ms per step and share; the top kernels; the instrumented
step against the plain one (what the instrument itself costs); and the step's matrix products
(``products``): their FLOPs a step (the runner reads each call's from its operands' shapes),
their time and GFLOP/s, in all and per function (a bfloat16 weight's products are other
functions than float32 ones), which profile@ reads against the sgemm peak it measures beside.
"""
from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from pipelines.phases import Build
from pipelines.runtime.native import build_runner, run_native, save_data, step_directory

TOP = 15
# kernel name -> kind: the first pattern found in the name decides (a fused kernel is named
# after its operators, the first one leading)
KINDS = [("^(fused_)?conv2d_transpose", "conv2d transpose (input gradient)"),
         ("^(fused_)?conv2d", "conv2d"),
         ("^(fused_)?(matmul|gemm)|^pockengine_sgemm", "matmul"),
         ("batch_norm|variance|mean", "batch norm"),
         ("softmax|nll_loss", "loss"), (r"^(fused_)?(multiply\d*_)?sum", "reduction"),
         ("", "elementwise")]


def kind_of(symbol: str) -> str:
    if symbol.startswith("vm.builtin"):
        return "VM builtins"
    return next(kind for pattern, kind in KINDS if re.search(pattern, symbol))


def profile_step(build, initial: dict, batches: tuple, profile,
                 steps: int) -> tuple[list[tuple[str, float, float]], list[float], list[float]]:
    """One step's VM calls in order, (symbol, median seconds over the ``steps`` - 1 steps after
    the first, FLOPs: a matrix product's, else 0), and each step's time (ms), instrumented and
    plain: the step built in ``build``
    run by the native runner for ``profile`` (the host's) from ``initial`` on ``batches`` (as
    many as ``steps``)."""
    with tempfile.TemporaryDirectory(prefix="pock-profile-") as tmp:
        work = Path(tmp)
        runner = build_runner(profile, work / "runner")
        step = step_directory(build, initial, work / "step")
        (work / "data").mkdir()
        save_data(work / "data" / "train.safetensors", Build.load(build).signature, batches)
        logs = {}
        for name, extra in (("plain", ()), ("profiled", ("--profile",))):
            (work / name).mkdir()
            logs[name] = run_native(runner, step, work / "data", work / name, profile,
                                    args=("--steps", str(steps), *extra))
    calls = [(symbol, seconds, flops) for symbol, seconds, flops in logs["profiled"]["calls"]]
    return calls, logs["profiled"]["step_ms"], logs["plain"]["step_ms"]


def kernel_profile(build, initial: dict, batches: tuple, profile, warmup: int,
                   steps: int) -> dict:
    """The profile of the step built in ``build``, run from ``initial`` on ``batches`` (as many
    as ``warmup + steps``) by the native runner for ``profile``."""
    calls, instrumented, plain = profile_step(build, initial, batches, profile, warmup + steps)
    plain, instrumented = (float(np.median(t[warmup:])) for t in (plain, instrumented))
    built = Build.load(build)
    updates, scheme = set(built.built["update_kernels"]), built.signature["scheme"]
    phases, kinds, kernels = defaultdict(float), defaultdict(float), defaultdict(float)
    counts = defaultdict(int)
    loss_at = next(i for i, (s, _, _) in enumerate(calls) if "nll_loss" in s)
    for index, (symbol, seconds, _) in enumerate(calls):
        phase = "forward" if index <= loss_at else "update" if symbol in updates else "backward"
        phases[phase] += seconds
        kinds[kind_of(symbol)] += seconds
        kernels[(symbol, phase)] += seconds
        counts[(symbol, phase)] += 1
    total = sum(phases.values())

    def table(values: dict) -> dict:
        return {k: {"ms_per_step": v * 1e3, "share": v / total}
                for k, v in sorted(values.items(), key=lambda kv: -kv[1])}

    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP]
    return {
        "device": "host", "scheme": scheme, "steps": warmup + steps - 1,  # the first not counted
        "timed_by": "native runner",
        "calls_per_step": len(calls),
        "plain_step_ms": plain,
        "instrumented_step_ms": instrumented,
        "kernel_time_ms": total * 1e3,  # the sum of the calls' median times
        # what timing each call costs, spread over the calls
        "instrument_us_per_call": (instrumented - plain) / len(calls) * 1e3,
        "phases": table(phases), "kinds": table(kinds),
        "top_kernels": [{"kernel": symbol, "phase": phase, "kind": kind_of(symbol),
                         "calls_per_step": counts[(symbol, phase)],
                         "ms_per_step": seconds * 1e3, "share": seconds / total}
                        for (symbol, phase), seconds in top],
        "products": products(calls),
    }


def profile_against_peak(build, initial: dict, batches: tuple, profile, warmup: int,
                         steps: int) -> dict:
    """``kernel_profile``, its products read against the sgemm peak on the profile's cores,
    measured before and after it: the higher is the yardstick (the peak moves on a shared
    machine, and a low one would flatter the products); with the OpenBLAS kernels they ran."""
    from pipelines.evaluate.speed import in_fresh_process, openblas_kernels, sgemm_peak

    before = in_fresh_process(sgemm_peak, profile.cores)
    result = kernel_profile(build, initial, batches, profile, warmup, steps)
    after = in_fresh_process(sgemm_peak, profile.cores)
    products, peak = result["products"], max(before, after)
    products.update(sgemm_peak_gflop_per_s=peak, sgemm_peak_before_after=[before, after],
                    fraction_of_sgemm_peak=(products["gflop_per_s"] / peak
                                            if products["gflop_per_s"] else None))
    if openblas := in_fresh_process(openblas_kernels, build):
        products["openblas"] = openblas
    return result


def _rate(calls: list[tuple[str, float, float]]) -> dict:
    seconds, flops = sum(c[1] for c in calls), sum(c[2] for c in calls)
    return {"calls_per_step": len(calls), "gflop_per_step": flops / 1e9,
            "ms_per_step": seconds * 1e3, "gflop_per_s": flops / seconds / 1e9 if seconds else None}


def products(calls: list[tuple[str, float, float]]) -> dict:
    """The matrix products among ``calls`` (those with FLOPs): in all, and per function."""
    timed = [call for call in calls if call[2] > 0]
    by_function = defaultdict(list)
    for call in timed:
        by_function[call[0]].append(call)
    return {**_rate(timed), "functions": {symbol: _rate(group) for symbol, group
                                          in sorted(by_function.items(), key=lambda kv: kv[0])}}
