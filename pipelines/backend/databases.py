"""Tuning databases: per kernel (a PrimFunc, matched structurally), the best schedule found for
it on one device, as MetaSchedule records. Two feed a device's build:

- ``device_profiles/tuned/<device>/``: committed, pre-tuned for the reference workloads (what
  TVM's TopHub was), so a new user and CI get tuned code without tuning; gzipped JSON in a
  fixed order (tuning.py: merge_databases writes it);
- the tune stage's own (``artifacts/cases/<case>/<device>/tune/``): the committed records this
  step's kernels match, improved by ``tune.trials`` more trials when the profile asks for them.

The build applies them (cpu_schedules.py: schedule_cpu); the search lives in tuning.py.
"""
from __future__ import annotations

import gzip
import tempfile
from pathlib import Path

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms

from pipelines.io import ROOT

PRETUNED = ROOT / "device_profiles" / "tuned"  # a directory per device (layout.pretuned)
WORKLOADS, RECORDS = "workloads.json", "records.json"


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


def by_anchor_block(databases: list):
    """``databases``' records in one database that matches a kernel by its anchor block (its
    convolution or product) alone: a record tuned for a convolution serves the same
    convolution fused with other epilogues (a frozen batch norm's arithmetic, a ReLU6), its
    trace applied to the anchor block and the rest inlined (cpu_schedules.py)."""
    anchored = ms.database.MemoryDatabase(module_equality="anchor-block")
    for database in databases:
        for record in database.get_all_tuning_records():
            copy_record(record, anchored)
    return anchored


def mean_secs(record) -> float:
    runs = [float(s) for s in (record.run_secs or [])]
    return sum(runs) / len(runs) if runs else float("inf")


def select_records(kernels: dict[str, tirx.PrimFunc], databases: list,
                   directory: Path) -> dict[str, float]:
    """Write to ``directory`` a database of the best record of each kernel in ``databases``,
    in kernel-name order (the same inputs give the same bytes), or where it has none, of its
    anchor block; returns kernel -> its record's microseconds (the anchor's kernel's)."""
    out = open_database(directory, create=True)
    found, committed, anchored = {}, set(), None
    for name, func in kernels.items():
        record = best_record(databases, func)
        if record is None:  # a record of its anchor block, which the build applies
            anchored = by_anchor_block(databases) if anchored is None else anchored
            record = best_record([anchored], func)
        if record is None:
            continue
        found[name] = mean_secs(record) * 1e6
        key = tvm_ffi.structural_hash(record.workload.mod)
        if key in committed:  # one record serves equal kernels, or kernels of equal anchors
            continue
        committed.add(key)
        copy_record(record, out)
    return found

