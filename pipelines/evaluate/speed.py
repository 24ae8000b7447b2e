"""Speed and memory of a compiled step against its peers, in one run: the compiled step and the
peers ``benchmark.peers`` names (pipelines/peers: PyTorch eager with full backpropagation,
eager with the scheme's frozen layers frozen, `torch.compile`d full backpropagation, PEFT's
LoRA), each in its own process with the same batch and thread count. Each gives step times (ms)
and its peak resident memory above its process before the case was set up: the weights, the
optimizer state (the compiled step holds it from the start, PyTorch makes it in its first
step), activations and workspace. The ratios are compiled vs each peer.

The cases are timed in interleaved rounds (compiled, peers, compiled, peers, ...), not one after
the other: a shared machine's load comes and goes over seconds, and timed back to back one case
could get a quiet minute and the next a busy one. Interleaved, each case sees the same weather,
so their ratio holds where their absolute times do not (docs/tuning.md, "Timing"). Peers that
do not fit in memory beside each other (a real-size LLM's PyTorch peers take gigabytes each)
take their turn in later groups against the compiled step, interleaved the same way; one that
fits beside nothing takes turns with the compiled step, a fresh process of each per round.
``sgemm_peak`` measures what the machine's BLAS reaches (cuBLAS's for a GPU), the yardstick for
GFLOP/s. On a GPU (``Spec.device``), each case's memory is also what it holds on the GPU.

The timed cases are spawned (a fresh interpreter each: all they hold is their own); the checks
around them (first losses, the sgemm peak) fork from one server that has imported PyTorch and
TVM once (``in_fresh_process``), which would otherwise cost seconds a check.
"""
from __future__ import annotations

import gc
import importlib
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.io import read_json
from pipelines.layout import OPENBLAS_LIB, SIGNATURE
from pipelines.peers import PEERS, why_not
from pipelines.timing import step_times

COMPILED = "compiled"
# Which step's FLOPs the compiled step computes (the prune report's): the sparse one.
COMPILED_WORK = "pruned"


@dataclass
class Spec:
    """What every case's process needs (picklable)."""

    cores: int
    warmup: int
    steps: int  # timed steps per case at least, over all rounds
    batch: Path  # an .npz of the step's batch, by the step's data names (inputs, labels)
    build: Path  # the compiled step's directory
    initial: dict = field(repr=False)  # every parameter and buffer's initial value, by Relax name
    model: object = None  # a pipelines/config.py Model (frontend torch for the peers)
    optimizer: object = None
    rounds: int = 1  # interleaved rounds the timed steps are split into
    min_seconds: float = 0.0  # timed seconds per case at least, over all rounds
    device: str = "cpu"  # "cuda": a CUDA build, and its peers on the same GPU


# Imported once by the server the checks fork from. Importing runs no kernel, so no thread
# pool (OpenMP's, TVM's) exists yet to be lost in a fork; each check sets its own thread
# counts. One a machine lacks (TVM on a GPU host) is skipped.
PRELOADED = ["numpy", "torch", "tvm", "pipelines.runtime.step", __name__]


def make_step(case: str, spec: Spec):
    """A callable that runs one training step of ``case`` (the compiled step, or one of
    pipelines/peers) on the spec's batch, and the seconds its setup took: loading the compiled
    step (its library and state), or building the peer (its model, its optimizer). A peer's
    process reads only the compiled step's signature, so that its memory is its own."""
    import torch

    torch.set_num_threads(spec.cores)
    if spec.device == "cuda":  # fp32 against fp32, as the compiled step computes it
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    signature = read_json(Path(spec.build) / SIGNATURE)
    with np.load(spec.batch) as saved:
        batch = [saved[name] for name in signature["data"]]
    started = time.perf_counter()
    if case == COMPILED:
        from pipelines.runtime.step import CompiledStep  # the peers' processes need no TVM

        compiled = CompiledStep(spec.build, spec.initial)
        args = compiled.arguments(*batch)
        # the same batch each call; a step built in place goes on from the state it left
        step = lambda: compiled.function(*args)  # noqa: E731
    else:
        step = PEERS[case].make_step(spec, signature, batch)
    setup_s = time.perf_counter() - started
    if spec.device == "cuda":  # kernels run asynchronously: a step ends when the GPU is done
        return lambda: (step(), torch.cuda.synchronize()), setup_s
    return step, setup_s


def serve_case(case: str, spec: Spec, conn) -> None:
    """One case's process: warm up, say it is ready (with its peak resident memory so far),
    then time each round ``measure`` sends ((steps, seconds) at least); None ends it, answered
    with the peak resident memory (and GPU memory held)."""
    os.environ["TVM_NUM_THREADS"] = str(spec.cores)
    from contextlib import nullcontext

    from pipelines.runtime.peak_memory import (HeldOnGPU, PeakRSS, peak_resident_bytes,
                                                 release_freed, resident_bytes)

    for library in getattr(PEERS.get(case), "IMPORTS", ()):
        importlib.import_module(library)  # its import is not the case's footprint
    gpu = HeldOnGPU() if spec.device == "cuda" else nullcontext()
    with gpu:
        # The whole footprint: what the case holds once set up (weights; the compiled step's
        # optimizer state, which PyTorch makes in its first step) and what its steps add.
        before = resident_bytes()
        step, setup_s = make_step(case, spec)
        release_freed()  # the setup's temporaries: what the case holds is what counts
        # The initial values are in the case's own state or model now: this process's copy
        # goes (a real-size model's is gigabytes), and the baseline with it, so that what the
        # case holds still counts.
        set_up = resident_bytes() - before
        spec.initial = None
        gc.collect()
        release_freed()
        before = resident_bytes() - set_up
        with PeakRSS(since=before) as peak:
            # The time to a first step: the setup, then the first step, where torch.compile
            # compiles and PyTorch's optimizer makes its state.
            first = step_times(step, 0, 1)[0]
            step_times(step, max(spec.warmup - 1, 0), 0)
            held = gpu.read() if spec.device == "cuda" else None  # the others wait meanwhile
            conn.send({"ready": True, "process_peak_bytes": peak_resident_bytes()})
            while (round_ := conn.recv()) is not None:
                conn.send(step_times(step, 0, *round_))
    conn.send({"peak_rss_bytes": peak.above_baseline_bytes, "setup_s": setup_s,
               "first_step_ms": first,
               **({"peak_gpu_bytes": held} if held is not None else {})})


class _Case:
    """``serve_case`` in a fresh process, spoken to over a pipe."""

    def __init__(self, context, case: str, spec: Spec):
        self.case = case
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=serve_case, args=(case, spec, theirs),
                                       daemon=True)
        self.process.start()
        theirs.close()  # so a process that dies is an EOFError here, not a hang

    def receive(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the speed case {self.case} stopped (exit code "
                               f"{self.process.exitcode}); its error is printed above") from None

    def ask(self, message):
        self.conn.send(message)
        return self.receive()

    def close(self) -> None:
        self.process.kill()
        self.process.join()


def available_bytes() -> int:
    """What this machine can still give without swapping (MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


# Start another case only while the machine has room for this many of the largest process
# (case) warmed up so far: a peer may hold more than the largest so far (PyTorch's full BP
# more than the compiled full step), and the machine needs some for itself.
HEADROOM = 1.5


def time_interleaved(spec: Spec, cases: list[str], available=available_bytes
                     ) -> dict[str, dict]:
    """Each case's step times and peak memory, each case in its own process, warmed up one
    after the other (none warms up, or compiles, while another is timed), then timed in
    ``spec.rounds`` rounds, each case in turn, the order rotating each round.

    The first case (the compiled step) stays up while the others start, as long as the machine
    has room for another of the largest process warmed up so far (its whole peak, libraries
    included). Those that do not fit take their turn in a later group, timed against the first
    case in the same way. One that does not fit even beside the first alone takes turns with
    it: each round a fresh process of each, one after the other, one process up at a time.
    Every peer is measured; no two run beside each other where the machine cannot hold them.
    ``processes``: how many processes a case was timed in."""
    from pipelines.progress import progress

    # spawned, not forked: a forked process faults its libraries' pages in as it runs them,
    # which its resident memory would count as the case's own
    context = multiprocessing.get_context("spawn")
    times, memory = {case: [] for case in cases}, {}
    processes = dict.fromkeys(cases, 0)
    round_ = (math.ceil(spec.steps / spec.rounds), spec.min_seconds / spec.rounds)
    largest = 0  # the largest process's whole peak so far
    up: list[_Case] = []  # the processes up now

    def start(case: str) -> _Case:
        nonlocal largest
        worker = _Case(context, case, spec)
        up.append(worker)
        largest = max(largest, worker.receive()["process_peak_bytes"])
        processes[case] += 1
        return worker

    def stop(worker: _Case) -> None:
        """Its memory (the highest of its processes'; setup and first step: its first's)."""
        measured, kept = worker.ask(None), memory.get(worker.case, {})
        memory[worker.case] = {**measured, **kept, **{
            key: max(measured[key], kept.get(key, 0))
            for key in ("peak_rss_bytes", "peak_gpu_bytes") if key in measured}}
        worker.close()
        up.remove(worker)

    try:
        first, pending = None, list(cases[1:])
        while True:
            if first is None:
                first = start(cases[0])
            group = []
            while pending and available() > HEADROOM * largest:
                group.append(start(pending.pop(0)))
            if pending and not group:  # the next fits beside nothing: they take turns
                alone = pending.pop(0)
                for index in progress(range(spec.rounds), f"speed: {alone} in turn"):
                    for case in [cases[0], alone][::1 if index % 2 == 0 else -1]:
                        if case == alone:
                            if first is not None:
                                stop(first)
                                first = None
                            worker = start(alone)
                            times[alone] += worker.ask(round_)
                            stop(worker)
                        else:
                            if first is None:
                                first = start(case)
                            times[case] += first.ask(round_)
            else:
                workers = [first, *group]
                for index in progress(range(spec.rounds), f"speed: {len(workers)} cases"):
                    turn = index % len(workers)
                    for worker in workers[turn:] + workers[:turn]:
                        times[worker.case] += worker.ask(round_)
                for worker in group:  # done: its memory goes back before the next starts
                    stop(worker)
            if not pending:
                break
        if first is not None:
            stop(first)
    finally:
        for worker in up:
            worker.close()
    return {case: {"median_ms": float(np.median(times[case])),
                   "p90_ms": float(np.percentile(times[case], 90)),
                   **memory[case], "steps": len(times[case]), "processes": processes[case]}
            for case in cases}


def in_fresh_process(function, *args):
    """``function(*args)`` in a process of its own, forked from a server that has imported
    ``PRELOADED`` (not from this process and its state); a process that dies (a native crash)
    is a BrokenProcessPool error here, not a hang."""
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def _product_gflops(product, size: int, repeats: int) -> float:
    """GFLOP/s of ``product()``, a size x size x size float32 matrix product (median time)."""
    return 2 * size**3 / (float(np.median(step_times(product, 1, repeats))) / 1e3) / 1e9


def sgemm_peak(cores: int, size: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of a float32 matrix product on ``cores`` threads (numpy's OpenBLAS): what this
    machine's tuned BLAS reaches, the ceiling a training step's GFLOP/s is read against."""
    from threadpoolctl import threadpool_limits  # numpy is loaded already: limit its BLAS

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    with threadpool_limits(limits=cores, user_api="blas"):
        return _product_gflops(lambda: a @ a, size, repeats)


def gpu_sgemm_peak(_cores: int, size: int = 4096, repeats: int = 20) -> float:
    """GFLOP/s of a float32 matrix product on the GPU through cuBLAS (PyTorch), TF32 off as in
    the steps it is read against."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(size, size, device="cuda")
    return _product_gflops(lambda: (a @ a, torch.cuda.synchronize()), size, repeats)


def openblas_kernels(build: Path) -> dict | None:
    """Which of OpenBLAS's kernels the step's products run on this machine: the core it names
    (``core``), and OPENBLAS_CORETYPE where the environment forces one (``forced``; some set
    an older core for older OpenBLAS builds, and its kernels can be half as fast: docs/tuning.md,
    "OpenBLAS's kernels"). None for a step without OpenBLAS. Read in a fresh process: what
    the library chooses when it loads, in this process's environment."""
    import ctypes

    library = Path(build) / OPENBLAS_LIB
    if not library.is_file():
        return None
    corename = ctypes.CDLL(str(library)).scipy_openblas_get_corename
    corename.restype = ctypes.c_char_p
    return {"core": corename().decode(), "forced": os.environ.get("OPENBLAS_CORETYPE")}


def peer_losses(case: str, spec: Spec, steps: int) -> tuple[list, list]:
    """A checked peer's losses over its first ``steps`` on the spec's batch, and PyTorch's
    doing the same update (pipelines/peers: ``check_losses``)."""
    import torch

    torch.set_num_threads(spec.cores)
    signature = read_json(Path(spec.build) / SIGNATURE)
    with np.load(spec.batch) as saved:
        batch = [saved[name] for name in signature["data"]]
    return PEERS[case].check_losses(spec, signature, batch, steps)


def check_peers(spec: Spec, peers: list[str]) -> tuple[dict, dict]:
    """Each peer that is not PyTorch (one with ``check_losses``) run for its first steps, in a
    fresh process, against PyTorch doing the same update: their losses by peer, and why each
    peer that failed or disagreed is not timed."""
    from pipelines.evaluate.finetune import CHECKED_STEPS, LOSS_RTOL

    losses, failed = {}, {}
    for peer in peers:
        if not hasattr(PEERS[peer], "check_losses"):
            continue
        try:
            theirs, pytorch = in_fresh_process(peer_losses, peer, spec, CHECKED_STEPS)
        except Exception as error:  # noqa: BLE001 - a peer's failure is reported, not raised
            failed[peer] = f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        losses[peer] = {"peer": theirs, "pytorch": pytorch}
        if not np.allclose(theirs, pytorch, rtol=LOSS_RTOL, atol=0):
            failed[peer] = (f"disagrees: its first losses {theirs} are not PyTorch's {pytorch} "
                            f"(rtol {LOSS_RTOL})")
    return losses, failed


def measure(spec: Spec, peers: list[str], report: dict) -> dict:
    """The compiled step and each of ``peers``, each in its own process, with GFLOP/s (from the
    prune ``report``'s FLOPs), examples (tokens, for a token grid) per second, and the ratios
    of compiled vs each peer. A peer that cannot do the case, fails or disagrees with PyTorch
    is not timed; ``not_timed`` says why."""
    signature = read_json(Path(spec.build) / SIGNATURE)
    skipped = {peer: reason for peer in peers
               if (reason := why_not(peer, signature, spec.model))}
    losses, failed = check_peers(spec, [peer for peer in peers if peer not in skipped])
    skipped.update(failed)
    peers = [peer for peer in peers if peer not in skipped]
    results = time_interleaved(spec, [COMPILED, *peers])
    for peer, checked in losses.items():
        if peer in results:
            results[peer]["first_losses"] = checked
    peak = in_fresh_process(gpu_sgemm_peak if spec.device == "cuda" else sgemm_peak, spec.cores)
    openblas = in_fresh_process(openblas_kernels, spec.build) if spec.device == "cpu" else None
    with np.load(spec.batch) as batch:
        x = batch[batch.files[0]]  # the model's first input
    tokens = x.dtype.kind in "iu" and x.ndim == 2  # a token grid: tokens/s, as LLMs are read
    unit, count = ("tokens", x.shape[0] * x.shape[1]) if tokens else ("examples", x.shape[0])
    for case, row in results.items():
        work = COMPILED_WORK if case == COMPILED else PEERS[case].WORK
        row["gflop_per_s"] = report[work]["flops"] / row["median_ms"] / 1e6
        row["fraction_of_sgemm_peak"] = row["gflop_per_s"] / peak
        row[f"{unit}_per_s"] = count / row["median_ms"] * 1e3
    compiled = results[COMPILED]
    ratios = {f"speedup_vs_{peer}": results[peer]["median_ms"] / compiled["median_ms"]
              for peer in peers}
    eager = results.get("torch_eager_full")
    held = "peak_gpu_bytes" if spec.device == "cuda" else "peak_rss_bytes"
    if eager is not None:  # null when PyTorch's peak did not rise above its baseline
        ratios["memory_vs_torch_eager_full"] = (compiled[held] / eager[held]
                                                if eager[held] else None)
    return {**results, **ratios, "sgemm_peak_gflop_per_s": peak,
            **({"openblas": openblas} if openblas else {}),
            **({"not_timed": skipped} if skipped else {})}
