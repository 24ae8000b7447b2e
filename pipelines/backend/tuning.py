"""Kernel tuning with MetaSchedule: the search over a step's costliest kernels (``tune``, for the
tune stage when a profile asks for ``tune.trials``), timing a kernel as the build schedules it,
checking a tuned schedule computes what the default one does, and merging records into the
committed database (`pock pretuned`). Databases themselves: databases.py; applying them:
cpu_schedules.py (schedule_cpu).

Why candidates are built in this process: TVM's ``LocalBuilder`` starts a new pool of worker
processes for every batch (its comment: a memory leak in reused workers), and each worker
imports TVM again, which costs more than the building (docs/tuning.md, "Why tuning was slow"); the
candidates are still timed in ``LocalRunner``'s one long-lived worker, so a crashing candidate
cannot take the stage down.
"""
from __future__ import annotations

import gzip
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

from pipelines.backend.cpu_schedules import schedule_cpu
from pipelines.backend.databases import (RECORDS, WORKLOADS, best_record, copy_record,
                                         mean_secs, open_database, workload)
from pipelines.timing import step_times

TRIALS_PER_BATCH = 16


def kernel_us(func: tirx.PrimFunc, target, database=None) -> float:
    """Median microseconds of one call of ``func`` on this machine, scheduled as the build
    would: by ``database`` where it has a record, else by the default schedules."""
    kernel = tvm.compile(schedule_cpu(workload(func), target, database)[0], target=target)["main"]
    args = [tvm.runtime.tensor(np.zeros([int(d) for d in p.shape], str(p.dtype)))
            for p in func.params]
    # Enough calls per sample that one sample lasts about a millisecond.
    calls = max(1, int(1.0 / max(min(step_times(lambda: kernel(*args), 1, 3)), 1e-3)))
    samples = step_times(lambda: [kernel(*args) for _ in range(calls)], 1, 7)
    return float(np.median(samples)) * 1e3 / calls


def computes_the_same(func: tirx.PrimFunc, target, database) -> bool:
    """Whether ``func`` scheduled by ``database`` gives what its default schedule gives, on
    seeded random inputs (float32 rounding apart). MetaSchedule times candidates but never
    checks them: one tuned schedule here (two nested rfactors of a variance) computed wrong
    numbers, so no record is kept or committed without this check."""
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype))
              if "float" in str(p.dtype) else np.zeros([int(d) for d in p.shape], str(p.dtype))
              for p in func.params]
    default, _ = schedule_cpu(workload(func), target)
    tuned, taken = schedule_cpu(workload(func), target, database)
    if not (taken["tuned"] or taken["anchor"]):
        return False
    outputs = []
    for mod in (default, tuned):
        args = [tvm.runtime.tensor(a.copy()) for a in inputs]
        tvm.compile(mod, target=target)["main"](*args)
        outputs.append([a.numpy() for a in args])
    # NaN where the default gives NaN: a batch norm's sqrt(var + eps) of a random negative var
    return all(np.allclose(t, d, rtol=1e-4, atol=1e-5, equal_nan=True)
               for d, t in zip(*outputs))


def merge_databases(directories: list[Path], destination: Path, target) -> int:
    """Write to ``destination`` (atomically) a database with the fastest record of every
    kernel any of ``directories`` holds that computes what the default schedule computes, in
    a fixed order, gzipped (the committed form: its workloads are 6 MB of JSON); returns how
    many kernels."""
    from pipelines.io import write_text_atomic

    best = {}
    for directory in directories:
        for record in open_database(directory).get_all_tuning_records():
            key = tvm_ffi.structural_hash(record.workload.mod)
            if key in best and mean_secs(record) >= mean_secs(best[key]):
                continue
            alone = ms.database.MemoryDatabase()
            copy_record(record, alone)
            if computes_the_same(record.workload.mod["main"], target, alone):
                best[key] = record
    with tempfile.TemporaryDirectory(prefix="pock-tuned-") as tmp:
        out = open_database(Path(tmp), create=True)
        for key in sorted(best):
            copy_record(best[key], out)
        Path(destination).mkdir(parents=True, exist_ok=True)
        for name in (WORKLOADS, RECORDS):
            write_text_atomic(Path(destination) / (name + ".gz"),
                              gzip.compress((Path(tmp) / name).read_bytes(), mtime=0))
            (Path(destination) / name).unlink(missing_ok=True)  # an older, plain form
    return len(best)


@derived_object
class InProcessBuilder(PyBuilder):
    """Builds MetaSchedule's candidates in this process, one after another (see the module
    docstring for why not in TVM's per-batch worker pool), into ``directory``, which goes with
    the tuning's working directory."""

    def __init__(self, directory: Path, label: str = "tune"):
        self.directory, self.label, self.built = Path(directory), label, 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()

    def build(self, build_inputs):
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
        from tvm.support.tar import tar

        results = []
        for given in build_inputs:
            try:  # what LocalBuilder's default build and export do, without the pool
                mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(given.mod)
                library = tvm.compile(mod, target=given.target)
                self.built += 1
                # A directory per candidate: once it is timed, MetaSchedule deletes the
                # directory its file is in (as it does LocalBuilder's temporary ones).
                directory = self.directory / f"candidate{self.built}"
                directory.mkdir(parents=True)
                path = str(directory / f"step.{tar.output_format}")
                library.export_library(path, fcompile=tar)
                results.append(BuilderResult(path, None))
            except Exception as error:  # a candidate that does not build is reported, not fatal
                results.append(BuilderResult(None, f"{type(error).__name__}: {error}"))
        # The first round sends every kernel a batch before any is timed: say it is moving.
        print(f"{self.label}: {self.built} candidates built, "
              f"{time.monotonic() - self.start:.0f} s", flush=True)
        return results


@derived_object
class Progress(PyMeasureCallback):
    """One line per batch of measured candidates: trials so far, the kernel, its best time."""

    def __init__(self, label: str, total: int, names: list[str]):
        self.label, self.total, self.names = label, total, names
        self.done, self.best, self.start = 0, {}, time.monotonic()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
              runner_results):
        self.done += len(measure_candidates)
        times = [sum(float(s) for s in r.run_secs) / len(r.run_secs)
                 for r in runner_results if r.run_secs and not r.error_msg]
        name = self.names[task_id]
        if times:
            self.best[name] = min(self.best.get(name, float("inf")), min(times))
        elapsed = time.monotonic() - self.start
        best = f"{self.best[name] * 1e6:.1f} us" if name in self.best else "no valid candidate"
        print(f"{self.label}: {self.done}/{self.total} trials, {elapsed:.0f} s "
              f"({self.done / max(elapsed, 1e-9):.2f} trials/s); {name}: best {best}",
              flush=True)


def tune(kernels: dict[str, tirx.PrimFunc], weights: dict[str, int], target, trials: int,
         work_dir: Path, start: list, seed: int, cores: int, label: str):
    """MetaSchedule over ``kernels`` (each weighted by its calls per step) for ``trials``
    trials in all, starting from the records ``start`` holds for them; returns the database
    of everything measured (the starting records included)."""
    # The task scheduler prints a table of every task after every batch; the progress
    # callback's one line says what matters.
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    database = open_database(work_dir / "database", create=True)
    unique = {}
    for name, func in kernels.items():  # equal kernels under other names: one task, summed
        unique.setdefault(tvm_ffi.structural_hash(workload(func)), []).append(name)
    names = [group[0] for group in unique.values()]
    for name in names:
        record = best_record(start, kernels[name])
        if record is not None:
            copy_record(record, database)
    loggers = ms.logging.get_loggers_from_work_dir(str(work_dir), names)
    seeds = ms.utils.fork_seed(seed, n=len(names))
    tasks = [ms.TuneContext(mod=workload(kernels[name]), target=target,
                            space_generator="post-order-apply", search_strategy="evolutionary",
                            task_name=name, logger=logger, rand_state=state,
                            num_threads=cores).clone()
             for name, logger, state in zip(names, loggers, seeds)]
    task_weights = [float(sum(weights.get(n, 1) for n in group)) for group in unique.values()]
    ms.tune.tune_tasks(
        tasks=tasks, task_weights=task_weights, work_dir=str(work_dir),
        max_trials_global=trials, num_trials_per_iter=TRIALS_PER_BATCH,
        builder=InProcessBuilder(work_dir / "candidates", label), runner=ms.runner.LocalRunner(), database=database,
        measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                           Progress(label, trials, names)])
    return database

