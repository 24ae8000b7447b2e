"""Speed and memory of a compiled step against PyTorch, in one run: the compiled step, PyTorch
eager with full backpropagation, eager with the scheme's frozen layers frozen, and
`torch.compile`d full backpropagation (the peers ``benchmark.peers`` names), each in a fresh
process with the same batch and thread count. Each gives step times (ms) and peak resident
memory above its process's baseline; the ratios are compiled vs each peer, measured minutes
apart at most. ``sgemm_peak`` measures what the machine's BLAS reaches, the yardstick for
GFLOP/s.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.timing import step_times

COMPILED = "compiled"
# Which step's FLOPs each case computes (the prune report): the compiled step and PyTorch with
# frozen layers do the sparse step's work, the others all of full backpropagation.
WORK = {COMPILED: "pruned", "torch_eager_frozen": "pruned", "torch_eager_full": "full",
        "torch_compile_full": "full"}


@dataclass
class Spec:
    """What every case's process needs (picklable)."""

    cores: int
    warmup: int
    steps: int
    batch: Path  # an .npz with x and y: the step's batch
    build: Path  # the compiled step's directory
    initial: dict = field(repr=False)  # every parameter and buffer's initial value, by Relax name
    model: object = None  # a pipelines/config.py Model (frontend torch for the peers)
    optimizer: object = None


def run_case(case: str, spec: Spec) -> dict:
    """Time ``case`` in this process (a fresh one: ``measure`` spawns it)."""
    os.environ["TVM_NUM_THREADS"] = str(spec.cores)
    import torch

    from pipelines.runtime.peak_memory import PeakRSS
    from pipelines.runtime.step import CompiledStep

    torch.set_num_threads(spec.cores)
    with np.load(spec.batch) as batch:
        x, y = batch["x"], batch["y"]
    compiled = CompiledStep(spec.build, spec.initial)
    if case == COMPILED:
        args = compiled.arguments(x, y)

        def step():  # the state passed in is not mutated: every call times the same step
            compiled.function(*args)
    else:
        from pipelines.evaluate.twin import torch_twin
        from pipelines.models.torch_twin import make_optimizer, train_step
        from pipelines.runtime.step import selection_of

        # full BP runs the plain model; frozen runs the scheme's, LoRA adapters and all
        frozen = case == "torch_eager_frozen"
        model = torch_twin(spec.model, compiled.signature, spec.initial, adapters=frozen)
        opt = make_optimizer(model, spec.optimizer,
                             selection_of(compiled.signature) if frozen else None)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        # torch.compile: forward and backward compiled (Inductor, C++ on the CPU), the update
        # eager; compiling happens in the first warm-up step, outside the timed ones.
        net = torch.compile(model) if case == "torch_compile_full" else model

        def step():
            train_step(net, opt, tx, ty, task=compiled.signature["task"])

    # The same wall-clock loop for every case; the peak counts from before the first step,
    # because warm-up allocates too.
    with PeakRSS() as peak:
        times = step_times(step, spec.warmup, spec.steps)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "peak_rss_bytes": peak.above_baseline_bytes, "steps": len(times)}


def in_fresh_process(function, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def sgemm_peak(cores: int, size: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of a float32 matrix product on ``cores`` threads (numpy's OpenBLAS): what this
    machine's tuned BLAS reaches, the ceiling a training step's GFLOP/s is read against."""
    from threadpoolctl import threadpool_limits  # numpy is loaded already: limit its BLAS

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    times = []
    with threadpool_limits(limits=cores, user_api="blas"):
        a @ a
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
    return 2 * size**3 / float(np.median(times)) / 1e9


def measure(spec: Spec, peers: list[str], report: dict) -> dict:
    """The compiled step and each of ``peers``, each in a fresh process, with GFLOP/s (from the
    prune ``report``'s FLOPs), examples (tokens, for a token grid) per second, and the ratios
    of compiled vs each peer."""
    from pipelines.progress import progress

    results = {case: in_fresh_process(run_case, case, spec)
               for case in progress([COMPILED, *peers], "speed")}
    peak = in_fresh_process(sgemm_peak, spec.cores)
    with np.load(spec.batch) as batch:
        x = batch["x"]
    tokens = x.dtype.kind in "iu" and x.ndim == 2  # a token grid: tokens/s, as LLMs are read
    unit, count = ("tokens", x.shape[0] * x.shape[1]) if tokens else ("examples", x.shape[0])
    for case, row in results.items():
        row["gflop_per_s"] = report[WORK[case]]["flops"] / row["median_ms"] / 1e6
        row["fraction_of_sgemm_peak"] = row["gflop_per_s"] / peak
        row[f"{unit}_per_s"] = count / row["median_ms"] * 1e3
    compiled = results[COMPILED]
    ratios = {f"speedup_vs_{peer}": results[peer]["median_ms"] / compiled["median_ms"]
              for peer in peers}
    eager = results.get("torch_eager_full")
    if eager is not None:  # null when PyTorch's peak did not rise above its baseline
        ratios["memory_vs_torch_eager_full"] = (compiled["peak_rss_bytes"]
                                                / eager["peak_rss_bytes"]
                                                if eager["peak_rss_bytes"] else None)
    return {**results, **ratios, "sgemm_peak_gflop_per_s": peak}
