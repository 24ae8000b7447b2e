"""Kernel tuning with MetaSchedule, and the tuning databases a CPU build applies.

A tuning database holds, per kernel (a PrimFunc, matched structurally), the best schedule found
for it on one device. The build applies it before the default schedules
(pipelines/backend/cpu_schedules.py): a kernel with a record takes its tuned schedule, the others the
default one. Two databases feed a device's build:

- ``device_profiles/tuned/<device>/``: committed, pre-tuned for the reference workloads (what
  TVM's TopHub was), so a new user and CI get tuned code without tuning;
- the tune stage's own (``artifacts/cases/<case>/<device>/tune/``): the committed records this step's kernels
  match, improved by ``tune.trials`` more trials of MetaSchedule when the profile asks for them.

Why candidates are built in this process: TVM's ``LocalBuilder`` starts a new pool of worker
processes for every batch (its comment: a memory leak in reused workers), and each worker
imports TVM again. Here 32 trials of one matrix product took 505 s with it and 41 s built in
process (/tmp experiment, recorded in the issue note); the candidates are still timed in
``LocalRunner``'s one long-lived worker, so a crashing candidate cannot take the stage down.
"""
from __future__ import annotations

import gzip
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.schedule.schedule import ScheduleError

from pipelines.backend.cpu_schedules import with_cpu_schedules
from pipelines.io import ROOT
from pipelines.timing import step_times

PRETUNED = ROOT / "device_profiles" / "tuned"
WORKLOADS, RECORDS = "workloads.json", "records.json"
TRIALS_PER_BATCH = 16


def pretuned(device: str) -> Path:
    """The committed database of ``device`` (may not exist: no records committed)."""
    return PRETUNED / device


def tunable_kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The kernels a CPU build schedules: unscheduled PrimFuncs with a root block (the
    hand-written ones without, e.g. take_backward, keep TVM's code), by name."""
    kernels = {}
    for gvar, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):
        if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get(
                "tirx.is_scheduled")):
            continue
        try:
            s_tir.Schedule(func).get_sblock("root")
        except ScheduleError:
            continue
        kernels[gvar.name_hint] = func
    return kernels


def workload(func: tirx.PrimFunc) -> tvm.IRModule:
    """The module MetaSchedule knows a kernel by: its name does not count, so equal kernels
    under different names share one record."""
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def copy_record(record, database) -> None:
    """Commit ``record`` (from another database) to ``database``, with its workload."""
    database.commit_tuning_record(ms.database.TuningRecord(
        record.trace, database.commit_workload(record.workload.mod), record.run_secs,
        record.target, record.args_info))


def open_database(directory: Path, create: bool = False):
    """The JSON database in ``directory``; where there is none, an empty one in memory, or
    with ``create`` a new one there. A committed database (``merge_databases``) is gzipped
    JSON, read into memory."""
    directory = Path(directory)
    if (directory / (WORKLOADS + ".gz")).exists():
        with tempfile.TemporaryDirectory(prefix="pock-tuned-") as plain:
            for name in (WORKLOADS, RECORDS):
                (Path(plain) / name).write_bytes(
                    gzip.decompress((directory / (name + ".gz")).read_bytes()))
            database = ms.database.MemoryDatabase()
            for record in open_database(Path(plain)).get_all_tuning_records():
                copy_record(record, database)
            return database
    if not (directory / WORKLOADS).exists():
        if not create:
            return ms.database.MemoryDatabase()
        directory.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(str(directory / WORKLOADS), str(directory / RECORDS),
                                    allow_missing=True)


def open_databases(directories: list[Path]):
    """One database in memory with every record ``directories`` hold: where several hold a
    kernel, MetaSchedule ranks its records by run time, so the fastest one is applied."""
    merged = ms.database.MemoryDatabase()
    for directory in directories:
        for record in open_database(directory).get_all_tuning_records():
            copy_record(record, merged)
    return merged


def best_record(databases: list, func: tirx.PrimFunc):
    """The fastest record any of ``databases`` holds for ``func``, or None."""
    best, best_secs = None, float("inf")
    for database in databases:
        mod = workload(func)
        if not database.has_workload(mod):
            continue
        for record in database.get_top_k(database.commit_workload(mod), 1):
            secs = mean_secs(record)
            if secs < best_secs:
                best, best_secs = record, secs
    return best


def mean_secs(record) -> float:
    runs = [float(s) for s in (record.run_secs or [])]
    return sum(runs) / len(runs) if runs else float("inf")


def select_records(kernels: dict[str, tirx.PrimFunc], databases: list,
                   directory: Path) -> dict[str, float]:
    """Write to ``directory`` a database of the best record of each kernel in ``databases``,
    in kernel-name order (the same inputs give the same bytes); returns kernel -> its record's
    microseconds."""
    out = open_database(directory, create=True)
    found, committed = {}, set()
    for name, func in kernels.items():
        record = best_record(databases, func)
        if record is None:
            continue
        found[name] = mean_secs(record) * 1e6
        key = tvm_ffi.structural_hash(workload(func))
        if key in committed:  # an equal kernel under another name: one record serves both
            continue
        committed.add(key)
        copy_record(record, out)
    return found


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


def apply_database(mod: tvm.IRModule, target, database) -> tuple[tvm.IRModule, list[str]]:
    """A copy of ``mod`` whose kernels with a record in ``database`` carry their tuned schedule
    (marked scheduled, so the default schedules leave them); and the names of those kernels."""
    out, tuned = mod.clone(), []
    for name, func in tunable_kernels(mod).items():
        schedule = database.query_schedule(workload(func), target=target, workload_name="main")
        if schedule is None:
            continue
        scheduled = schedule.mod["main"].without_attr("global_symbol")  # the kernel's own name:
        if func.attrs and "global_symbol" in func.attrs:
            scheduled = scheduled.with_attr("global_symbol", func.attrs["global_symbol"])
        out[out.get_global_var(name)] = scheduled.with_attr("tirx.is_scheduled", True)
        tuned.append(name)
    return out, tuned


def schedule_cpu(mod: tvm.IRModule, target, database=None) -> tuple[tvm.IRModule, Counter]:
    """``mod`` as a CPU build schedules it: kernels with a record in ``database`` take their
    tuned schedule, the rest the default one; with how many kernels each way went."""
    tuned = []
    if database is not None and target.kind.name == "llvm":
        mod, tuned = apply_database(mod, target, database)
    mod, taken = with_cpu_schedules(mod, target)
    return mod, taken + Counter(tuned=len(tuned))


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
    if not taken["tuned"]:
        return False
    outputs = []
    for mod in (default, tuned):
        args = [tvm.runtime.tensor(a.copy()) for a in inputs]
        tvm.compile(mod, target=target)["main"](*args)
        outputs.append([a.numpy() for a in args])
    return all(np.allclose(t, d, rtol=1e-4, atol=1e-5) for d, t in zip(*outputs))


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
