"""Tuned schedules (pipelines/backend/databases.py, tuning.py, tune_step.py): the committed
pre-tuned records compute what the default schedules compute (seeded random inputs, rtol 1e-4,
atol 1e-5: computes_the_same), the database the tune stage writes is the same bytes for the
same inputs, and bad settings are refused. A step built with the records is checked against
PyTorch in tests/test_train_step.py. Nothing here tunes: the records are the committed ones of
device_profiles/tuned/."""
import re
from pathlib import Path

import pytest
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from conftest import plan_case
from pipelines.backend.cpu_schedules import tunable_kernels
from pipelines.backend.databases import (PRETUNED, copy_record, open_database, select_records,
                                         workload)
from pipelines.backend.tuning import InProcessBuilder, computes_the_same, merge_databases
from pipelines.schema import ConfigError
from pipelines.io import ROOT
from pipelines.profiles import load_profile, tvm_target

HOST = load_profile("host", {})
TARGET = tvm_target(HOST)
COMMITTED_DIR = ROOT / PRETUNED
COMMITTED = open_database(COMMITTED_DIR / "host")


def committed_kernels() -> list:
    return [record.workload.mod for record in COMMITTED.get_all_tuning_records()]


def test_a_pretuned_database_is_committed_for_the_host():
    assert len(committed_kernels()) > 0


@pytest.mark.slow  # every committed kernel built twice and run (a minute for the host's)
@pytest.mark.parametrize("device", sorted(path.name for path in COMMITTED_DIR.iterdir()))
def test_committed_records_compute_what_the_default_schedules_compute(device):
    # Seeded random inputs, float32 rounding apart (rtol 1e-4, atol 1e-5): the check that
    # dropped a wrong MetaSchedule schedule when the database was committed. Every committed
    # database is for a profile whose code runs here (tuning needs that).
    database, target = open_database(COMMITTED_DIR / device), tvm_target(load_profile(device, {}))
    records = database.get_all_tuning_records()
    assert records
    for record in records:
        mod = record.workload.mod
        assert computes_the_same(mod["main"], target, database), mod["main"].script()[:400]


# The main pipeline's default steps (conf/experiment/default.yaml): MobileNetV2 with the paper's
# scheme (case mbv2) and with full backpropagation (case mbv2_full), the kernels the records
# were tuned for.
@pytest.fixture(scope="module")
def paper_step(params):
    return plan_case(params, "mbv2")[2].module


@pytest.mark.slow
def test_the_tune_stage_selects_the_same_bytes_twice(tmp_path, paper_step):
    from pipelines.backend.blas import switch_backends
    from pipelines.backend.tune_step import calls_per_step

    mod = switch_backends(paper_step, {})
    kernels = tunable_kernels(mod)
    assert calls_per_step(mod)  # every kernel the step calls is counted
    first = select_records(kernels, [COMMITTED], tmp_path / "a")
    second = select_records(kernels, [COMMITTED], tmp_path / "b")
    assert first and first == second
    for name in ("workloads.json", "records.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # Merging the committed database with itself changes nothing it holds.
    assert merge_databases([COMMITTED_DIR / "host", tmp_path / "a"], tmp_path / "merged",
                           TARGET) == len(committed_kernels())


def test_databases_opened_together_apply_the_fastest_record_any_of_them_holds(tmp_path):
    # What the schemes stage applies: the committed records and the tune stage's.
    first, second = COMMITTED.get_all_tuning_records()[:2]
    slower = ms.database.TuningRecord(first.trace, first.workload,
                                      [float(s) * 10 for s in first.run_secs], first.target,
                                      first.args_info)
    for directory, records in (("slow", [slower, second]), ("fast", [first])):
        database = open_database(tmp_path / directory, create=True)
        for record in records:
            copy_record(record, database)
    merged = ms.database.MemoryDatabase()  # every record of both: MetaSchedule ranks them
    for directory in (tmp_path / "slow", tmp_path / "fast"):
        for record in open_database(directory).get_all_tuning_records():
            copy_record(record, merged)
    top, = merged.get_top_k(merged.commit_workload(first.workload.mod), 1)
    assert [float(s) for s in top.run_secs] == [float(s) for s in first.run_secs]
    assert merged.query_schedule(second.workload.mod, target=TARGET,
                                 workload_name="main") is not None


@pytest.mark.slow
def test_the_committed_host_records_cover_full_backpropagation_too(params, paper_step):
    # The default experiment times full BP beside the paper's scheme: the kernels only full BP
    # has (the backward of the layers mbv2_paper freezes) were tuned too.
    paper = {tvm_ffi.structural_hash(workload(func))
             for func in tunable_kernels(paper_step).values()}
    full = plan_case(params, "mbv2_full")[2].module
    only_full = [workload(func) for func in tunable_kernels(full).values()
                 if tvm_ffi.structural_hash(workload(func)) not in paper]
    assert only_full and any(COMMITTED.has_workload(mod) for mod in only_full)


def test_equal_kernels_under_other_names_share_one_workload():
    mod = committed_kernels()[0]
    renamed = mod["main"].with_attr("global_symbol", "conv2d99")
    assert tvm_ffi.structural_equal(workload(renamed), workload(mod["main"]))


def test_the_in_process_builder_builds_and_reports_failures(tmp_path):
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.utils import remove_build_dir

    good = BuilderInput(committed_kernels()[0], TARGET)
    # A CPU triple LLVM does not know: the candidate fails, the batch goes on.
    bad = BuilderInput(committed_kernels()[0], tvm.target.Target(
        {"kind": "llvm", "mtriple": "nonsense-unknown-none"}))
    builder = InProcessBuilder(tmp_path)
    ok, failed = builder.build([good, bad])
    assert ok.error_msg is None and ok.artifact_path == str(tmp_path / "candidate1" / "step.tar")
    assert failed.artifact_path is None and "nonsense-unknown-none" in failed.error_msg
    # Once a candidate is timed, MetaSchedule deletes the directory its file is in: the next
    # batch must still build (with one shared directory, every later candidate failed).
    remove_build_dir(ok.artifact_path)
    again, = builder.build([good])
    assert again.error_msg is None and Path(again.artifact_path).exists()


@pytest.mark.parametrize("tune, message", [
    ({"trials": -1}, "tune.trials=-1: Input should be greater than or equal to 0"),
    ({"trials": "many"}, "tune.trials='many': Input should be a valid integer"),
    ({"seed": -2}, "tune.seed=-2: Input should be greater than or equal to 0"),
    ({"trails": 10}, "tune: unknown keys ['trails']; allowed: ['seed', 'trials']"),
])
def test_bad_tune_settings_are_named(tune, message):
    with pytest.raises(ConfigError, match=r"host\.yaml.*: " + re.escape(message)):
        load_profile("host", {"host": {"tune": tune}})


def test_tuning_needs_a_device_it_can_time():
    with pytest.raises(ConfigError, match=r"rpi4\.yaml.*: tune\.trials=8 needs candidates timed "
                                          r"on the device, but runner='emulated'"):
        load_profile("rpi4", {"rpi4": {"tune": {"trials": 8}}})
    assert load_profile("rpi4", {}).tune.model_dump() == {"trials": 0, "seed": 0}
    # A docker device runs on this machine's CPU, where its benchmark times it too.
    assert load_profile("edge_x86", {"edge_x86": {"tune": {"trials": 8}}}).tune.model_dump() == {
        "trials": 8, "seed": 0}


def test_a_missing_database_is_empty_and_not_created(tmp_path):
    database = open_database(tmp_path / "none")
    assert isinstance(database, ms.database.MemoryDatabase)
    assert not (tmp_path / "none").exists()
