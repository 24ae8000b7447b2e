"""Where a host build's step spends its time, kernel by kernel (profile@<case>).

The step runs with a VM instrument that times every call the VM makes (each
compiled kernel, and the VM's own builtins) over ``benchmark.steps`` steps after
``benchmark.warmup``. Each call is put in a phase by its place in the step and its role:
- forward: the calls up to the loss (the first ``nll_loss`` kernel; the fused one,
  ``softmax_nll_loss``, also computes the logits' gradient, and counts here);
- update: calls after the loss whose result is a new parameter or optimizer state (the step's
  outputs, as the build recorded them: analysis/liveness.py, update_kernels; batch norm's running statistics are new state too, but
  computed before the loss, so forward);
- backward: the other calls after the loss.
and in a kind by the operator its kernel name starts with (conv2d, its transpose, matmul,
batch norm, reductions, elementwise, VM builtins).
The result: per phase and per kind, ms per step and share; the top kernels; the instrumented
step against the plain one (what the instrument itself costs).
"""
from __future__ import annotations

import re
import time
from collections import defaultdict

import numpy as np

from pipelines.phases import Build
from pipelines.runtime.step import CompiledStep
from pipelines.timing import step_times

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


def profile_step(step: CompiledStep, args, warmup: int,
                 steps: int) -> tuple[list[list[tuple]], list[float]]:
    """Per timed step, the VM's calls in order, (symbol, seconds); and each instrumented step's
    time (ms)."""
    calls, started, per_step = [], [], []

    def instrument(func, symbol, before, ret, *rest):
        if before:
            started.append(time.perf_counter())
        else:
            calls.append((symbol, time.perf_counter() - started.pop()))
        return 0  # go on as usual

    def one_step():
        calls.clear()
        step.function(*args)
        per_step.append(list(calls))

    step.vm.set_instrument(instrument)
    times = step_times(one_step, warmup, steps)
    step.vm.set_instrument(None)
    return per_step[warmup:], times


def reference_outputs(build, initial: dict, batch: tuple) -> dict[str, np.ndarray]:
    """The outputs of one step of the build in ``build`` from ``initial`` on ``batch`` (the
    loss, then each new state tensor), by output name: what another build of the same step
    must give on the same arguments (phases.Reference; evaluate/device.py)."""
    step = CompiledStep(build, initial)
    outputs = step.function(*step.arguments(*batch))
    return {name: value.numpy() for name, value in zip(step.signature["outputs"], outputs)}


def kernel_profile(build, initial: dict, batch: tuple, warmup: int, steps: int) -> dict:
    """The profile of the step built in ``build``, run from ``initial`` on ``batch``."""
    step = CompiledStep(build, initial)
    args = step.arguments(*batch)
    plain = float(np.median(step_times(lambda: step.function(*args), warmup, steps)))
    per_step, times = profile_step(step, args, warmup, steps)
    instrumented = float(np.median(times))
    updates = set(Build.load(build).built["update_kernels"])

    phases, kinds, kernels = defaultdict(float), defaultdict(float), defaultdict(float)
    counts = defaultdict(int)
    for calls in per_step:
        loss_at = next(i for i, (s, _) in enumerate(calls) if "nll_loss" in s)
        for index, (symbol, seconds) in enumerate(calls):
            phase = ("forward" if index <= loss_at else
                     "update" if symbol in updates else "backward")
            phases[phase] += seconds
            kinds[kind_of(symbol)] += seconds
            kernels[(symbol, phase)] += seconds
            counts[(symbol, phase)] += 1
    n = len(per_step)
    total = sum(phases.values()) / n

    def table(values: dict) -> dict:
        return {k: {"ms_per_step": v / n * 1e3, "share": v / n / total}
                for k, v in sorted(values.items(), key=lambda kv: -kv[1])}

    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:TOP]
    return {
        "device": "host", "scheme": step.signature["scheme"], "steps": n,
        "calls_per_step": len(per_step[0]),
        "plain_step_ms": plain,
        "instrumented_step_ms": instrumented,
        "kernel_time_ms": total * 1e3,  # the sum of the calls' times
        # The instrument is a Python callback: each timed call carries part of its cost, so
        # small calls (the VM builtins) read high. Spread over the calls:
        "instrument_us_per_call": (instrumented - plain) / len(per_step[0]) * 1e3,
        "phases": table(phases), "kinds": table(kinds),
        "top_kernels": [{"kernel": symbol, "phase": phase, "kind": kind_of(symbol),
                         "calls_per_step": counts[(symbol, phase)] // n,
                         "ms_per_step": seconds / n * 1e3, "share": seconds / n / total}
                        for (symbol, phase), seconds in top],
    }
