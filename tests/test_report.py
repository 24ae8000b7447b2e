"""The report (pipelines/report/render.py): each committed `pock gpu bench` run rendered as a
table, a case that failed on the GPU said so with its error, nothing dropped; each package's
trial with both runners' figures, or why it did not run; a fine-tuned case's held-out score as
its task reads it; the time from a model to its first step, phase by phase; which OpenBLAS
kernels each timed run's products ran."""
import os
import shutil
from pathlib import Path

import pytest

from pipelines.evaluate.device import peer_ratios
from pipelines.evaluate.finetune import over_runs
from pipelines.evaluate.speed import openblas_kernels
from pipelines.layout import OPENBLAS_LIB
from pipelines.report.first_step import first_step_table
from pipelines.report.plots import gpu_rows, gpu_svg, peer_rows
from pipelines.report.render import (case_table, device_table, gpu_tables, openblas_lines,
                                     peer_table, product_lines)


def _timed(ms: float) -> dict:
    return {"median_ms": ms}


def test_each_gpu_run_is_a_table_with_its_ratios_and_failures():
    parity = {"matches": True, "loss_max_relative_error": 2e-6, "trained": 9, "layers": 2,
              "worst_diff_over_tolerance": 0.5}
    run = {"machine": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"},
           "mbv2_paper": {"parity": parity, "speed": {
               "compiled": {**_timed(2.0), "examples_per_s": 4000.0},
               "torch_eager_full": _timed(14.0),
               "speedup_vs_torch_eager_full": 7.0, "torch_eager_frozen": _timed(10.0),
               "speedup_vs_torch_eager_frozen": 5.0, "memory_vs_torch_eager_full": 0.05}},
           "smollm_full": {"parity": {"error": "timed out after 120 s"},
                           "speed": {"error": "timed out after 120 s"}}}
    lines = gpu_tables({"nvidia_h100": run})
    assert lines[0].startswith("## On an NVIDIA GPU: NVIDIA H100 80GB HBM3")
    (paper,) = [line for line in lines if line.startswith("| mbv2_paper")]
    assert "ok (losses 2.0e-06 rel; 9 trained, first 2 layers)" in paper
    assert "| 2.00 ms, 4,000 examples/s |" in paper and "14.00 ms (7.00x)" in paper and "10.00 ms (5.00x)" in paper and "0.05x" in paper
    (full,) = [line for line in lines if line.startswith("| smollm_full")]
    assert full.count("failed: timed out after 120 s") == 2  # parity and speed
    header = lines.index(next(line for line in lines if line.startswith("| case")))
    assert lines[header - 2] == "![speedups on the GPU](plots/gpu-nvidia_h100.svg)"
    assert "native runner" not in lines[header]  # a run without the runners: no such column
    native = {"ms_per_step": 0.7, "peak_rss_bytes": 128 * 2**20}
    run["mbv2_paper"]["runners"] = {
        "weights_bit_identical": True, "weights_max_abs_difference": 0.0,
        "native_speedup_vs_python": 1.75, "native": native,
        "python": {**native, "ms_per_step": 1.225, "peak_rss_bytes": 640 * 2**20}}
    lines = gpu_tables({"nvidia_h100": run})
    assert lines[header].endswith("| native runner |")
    assert lines[header + 1].count("|") == lines[header].count("|")
    (paper,) = [line for line in lines if line.startswith("| mbv2_paper")]
    assert paper.endswith("| 0.70 ms (1.75x the Python runner), host memory 128.00 MiB vs "
                          "640.00 MiB; same weights, bit for bit |")
    (full,) = [line for line in lines if line.startswith("| smollm_full")]
    assert full.count("|") == lines[header].count("|")
    # its plot: the compiled step's speed over each peer's, per case; the same bytes twice
    rows = gpu_rows(run)
    assert rows == [{"case": "mbv2_paper", "peer": "eager full", "speedup": 7.0},
                    {"case": "mbv2_paper", "peer": "eager frozen", "speedup": 5.0}]
    svg = gpu_svg(rows, "NVIDIA H100 80GB HBM3")
    assert svg.startswith("<?xml") and svg == gpu_svg(rows, "NVIDIA H100 80GB HBM3")


def test_packages_show_both_runners_or_why_they_did_not_run():
    runner = {"ms_per_step": 2.5, "peak_rss_bytes": 18 * 2**20, "image_bytes": 40 * 2**20}
    trial = {"verdict": "ok", "where": "emulated", "steps": 10, "bit_identical": False,
             "worst_diff_over_tolerance": 0.25, "native": runner,
             "python": {**runner, "peak_rss_bytes": 400 * 2**20, "image_bytes": 420 * 2**20}}
    found = {"benchmark": {}, "build": {}, "package": {
        "mbv2-rpi4": {"image": "pockengine/mbv2-rpi4:abc", "trial": trial},
        "mbv2-jetson": {"image": "pockengine/mbv2-jetson:def",
                        "trial": {"verdict": "not_run", "reason": "no qemu"}},
        "mbv2-host": None}}
    lines = device_table(found)
    (rpi4,) = [line for line in lines if line.startswith("| mbv2-rpi4")]
    assert ("| 10 steps, emulated | 2.50 ms/step, peak 18.00 MiB, image 40.00 MiB | 2.50 ms/step, "
            "peak 400.00 MiB, image 420.00 MiB | to 0.25x tolerance |") in rpi4
    (jetson,) = [line for line in lines if line.startswith("| mbv2-jetson")]
    assert "| no qemu |" in jetson
    assert not [line for line in lines if line.startswith("| mbv2-host")]


def test_a_device_run_shows_its_peak_or_that_it_did_not_fit():
    built = {"library": "step.so", "library_bytes": 2**20, "links_on_device": False,
             "target": '{"kind":"llvm","mcpu":"x86-64-v3"}'}
    fits = {"ran": True, "verdict": "ok", "runner": "docker", "matches_host": True, "loss": 2.5,
            "loss_host": 2.5, "container": {"median_ms": 900.0}, "peak_rss_bytes": 3 * 2**30}
    killed = {"ran": True, "verdict": "out_of_memory", "runner": "docker", "memory_mb": 8192.0}
    found = {"build": {"q_paper-board_8g": built, "q_full-board_8g": built}, "package": {},
             "benchmark": {"q_paper-board_8g": fits, "q_full-board_8g": killed}}
    rows = {line.split(" |")[0][2:]: line for line in device_table(found)
            if line.startswith("| q_")}
    assert rows["q_paper"].endswith("| 900.00 ms in a container (this machine's cores) "
                                    "| 3072.00 MiB |")
    assert rows["q_full"].endswith("| docker |  | out of memory | over 8192 MiB |")


def test_pytorch_in_the_device_container_shows_its_verdict_peak_loss_and_ratios():
    built = {"library": "step.so", "library_bytes": 2**20, "links_on_device": False,
             "target": '{"kind":"llvm","mcpu":"x86-64-v3"}'}
    peers = {"torch_eager_full": {"verdict": "out_of_memory", "memory_mb": 8192.0},
             "torch_eager_frozen": {"verdict": "ok", "peak_rss_bytes": 5 * 2**30,
                                    "matches_host": True, "loss": 12.25, "loss_host": 12.25,
                                    "container": {"median_ms": 2500.0}},
             "torch_eager_other": {"verdict": "failed", "reason": "RuntimeError: boom"}}
    fits = {"ran": True, "verdict": "ok", "runner": "docker", "matches_host": True, "loss": 2.5,
            "loss_host": 2.5, "container": {"median_ms": 900.0}, "peak_rss_bytes": 3 * 2**30,
            "peers": peers}
    fits.update(peer_ratios(fits))
    assert fits["speedup_vs_torch_eager_frozen"] == pytest.approx(2500 / 900)
    assert fits["memory_vs_torch_eager_frozen"] == pytest.approx(3 / 5)
    assert "speedup_vs_torch_eager_full" not in fits  # out of memory: no ratio
    found = {"build": {"q_paper-board_8g": built}, "package": {},
             "benchmark": {"q_paper-board_8g": fits}}
    rows = [line for line in device_table(found) if line.startswith("| q_paper | board_8g | ")]
    assert rows[1:] == [
        "| q_paper | board_8g | torch_eager_full | out_of_memory | over 8192 MiB |  | out of "
        "memory |  |",
        "| q_paper | board_8g | torch_eager_frozen | ok | 5120.00 MiB | matches (12.250000 vs "
        "12.250000) | 2500.00 ms in a container | 2.78x the speed, 0.60x the memory |",
        "| q_paper | board_8g | torch_eager_other | failed |  |  | RuntimeError: boom |  |"]
    # Where the native runner (what a package ships) ran the step too, the peers are compared
    # with its run; one whose loss is not the Python runner's is not what ships.
    native = {"verdict": "ok", "matches": True, "median_ms": 600.0, "peak_rss_bytes": 2**30,
              "first_loss": 2.5}
    shipped = {**fits, "native": native}
    shipped.update(peer_ratios(shipped))
    assert shipped["speedup_vs_torch_eager_frozen"] == pytest.approx(2500 / 600)
    assert shipped["memory_vs_torch_eager_frozen"] == pytest.approx(1 / 5)
    row = next(line for line in device_table({**found, "benchmark": {"q_paper-board_8g": shipped}})
               if line.startswith("| q_paper | board_8g | llvm"))
    assert row.endswith("| 900.00 ms in a container (this machine's cores); native runner "
                        "600.00 ms | 3072.00 MiB (native runner 1024.00 MiB) |")
    wrong = {**fits, "native": {**native, "matches": False}}
    assert peer_ratios(wrong)["memory_vs_torch_eager_frozen"] == pytest.approx(3 / 5)


def test_a_case_is_read_by_accuracy_or_a_language_model_by_perplexity():
    cost = {"trainable_fraction": 0.3, "backward_flops_vs_full": 0.4}
    plan = {"planned_peak_bytes": 2**20}
    tuned = {"classifier": {"accuracy_before": 0.1, "accuracy_compiled": 0.9,
                            "accuracy_pytorch": 0.89},
             "lm": {"held_out_loss_before": 4.5, "held_out_loss_compiled": 3.5,
                    "held_out_loss_pytorch": 3.5, "perplexity_before": 90.0,
                    "perplexity_compiled": 33.1, "perplexity_pytorch": 33.2},
             "runs": {"accuracy_before": 0.1, "accuracy_compiled": 0.9, "accuracy_pytorch": 0.8,
                      "runs": over_runs([0, 1], [{"accuracy_compiled": 0.9,
                                                  "accuracy_pytorch": 0.8},
                                                 {"accuracy_compiled": 0.96,
                                                  "accuracy_pytorch": 0.9}])},
             "timed": None}
    found = {"evaluate": {name: {"cost": cost, "plan": plan, "finetune": finetune}
                          for name, finetune in tuned.items()}}
    cases = {name: {"scheme": "full"} for name in tuned}
    lines = case_table("m", list(tuned), cases, found)
    row = {line.split(" |")[0][2:]: line for line in lines if line.startswith("| ")}
    assert row["classifier"].endswith("| 0.100, 0.900, 0.890 |")
    assert row["lm"].endswith("| 90.000, 33.100, 33.200 (perplexity) |")
    # several runs: their mean and standard deviation, not the first run's score
    assert row["runs"].endswith("| 0.100, 0.930 ± 0.030, 0.850 ± 0.050 (2 runs) |")
    assert row["timed"].endswith("| 1.00 MiB |  |")


def test_every_peer_that_timed_a_model_is_a_column_and_a_bar():
    def peer(ms: float) -> dict:
        return {"median_ms": ms, "peak_rss_bytes": 64 * 2**20}

    found = {"evaluate": {
        "mbv2": {"speed": {"compiled": {**peer(0.8), "examples_per_s": 1e4},
                           "ort_training_frozen": peer(15.0),
                           "speedup_vs_ort_training_frozen": 18.75,
                           "executorch_frozen": peer(68.0), "speedup_vs_executorch_frozen": 85.0,
                           "not_timed": {"executorch_full": "failed: ValueError: batch norm"}}},
        "mbv2_full": {"speed": {"compiled": {**peer(4.0), "examples_per_s": 2e3},
                                "ort_training_frozen": peer(20.0),
                                "speedup_vs_ort_training_frozen": 5.0}},
        "mbv2_plain": None}}
    names = ["mbv2", "mbv2_full", "mbv2_plain"]
    lines = peer_table("mbv2", names, found)
    assert lines[2] == "![mbv2: the compiled step's speedup over each peer](plots/peers-mbv2.svg)"
    assert lines[4] == "| case | compiled | ort_training_frozen | executorch_frozen |"
    (paper,) = [line for line in lines if line.startswith("| mbv2 |")]
    assert "| 15.00 ms (18.75x, 64.00 MiB) | 68.00 ms (85.00x, 64.00 MiB) |" in paper
    (full,) = [line for line in lines if line.startswith("| mbv2_full |")]
    assert full.endswith("| 20.00 ms (5.00x, 64.00 MiB) |  |")  # not timed: blank
    rows = peer_rows(names, found)
    assert [(r["case"], r["peer"], r["speedup"]) for r in rows] == [
        ("mbv2", "ort_training_frozen", 18.75), ("mbv2", "executorch_frozen", 85.0),
        ("mbv2_full", "ort_training_frozen", 5.0)]
    assert peer_table("llama", ["mbv2_plain"], found) == []  # nothing timed: no table


def test_the_time_to_a_first_step_adds_up_each_phase_and_the_first_step():
    def timed(seconds: float) -> dict:
        return {"seconds": seconds}

    speed = {"compiled": {"setup_s": 0.5, "first_step_ms": 500.0},
             "torch_compile_full": {"setup_s": 1.0, "first_step_ms": 9000.0}}
    found = {"evaluate": {"a": {"speed": speed}, "b": {"speed": speed}, "old": {"speed": {
        "compiled": {"median_ms": 1.0}}}},
        "time": {"import": {"m": timed(3.0)}, "lower": {"m": timed(2.0)},
                 "autodiff": {"a": timed(1.0), "b": timed(1.0), "old": timed(1.0)},
                 "prune": {"a": timed(1.0), "b": None, "old": timed(1.0)},
                 "optimize": {"a": timed(1.0), "old": timed(1.0)},
                 "tune": {"a-host": timed(1.0), "old-host": timed(1.0)},
                 "build": {"a-host": timed(10.0), "old-host": timed(1.0)}}}
    lines = first_step_table("m", ["a", "b", "old"], found)
    assert lines[0] == "### m: time to the first step (from the model, on the host)"
    (row,) = [line for line in lines if line.startswith("| a |")]
    # 19 s of phases (import and lower the model's), 1 s to load and step: 20 s; the peers'
    # setup and first step beside it (eager full did not time the case: blank)
    assert row == ("| a | 3.0 s | 2.0 s | 1.0 s | 1.0 s | 1.0 s | 1.0 s | 10.0 s | 19.0 s "
                   "| 1.0 s | **20.0 s** |  | 10.0 s |")
    # b's prune was not timed, old's first step was not: neither is a row
    assert not [line for line in lines if line.startswith(("| b |", "| old |"))]
    assert first_step_table("m", ["b"], found) == []


def test_a_run_says_which_openblas_kernels_its_products_ran(tmp_path):
    import scipy_openblas32

    assert openblas_kernels(tmp_path) is None  # a step whose products are all generated
    shutil.copyfile(Path(scipy_openblas32.get_lib_dir()) / OPENBLAS_LIB, tmp_path / OPENBLAS_LIB)
    blas = openblas_kernels(tmp_path)
    forced = os.environ.get("OPENBLAS_CORETYPE")
    assert blas["forced"] == forced
    assert blas["core"] and (not forced or blas["core"].lower() == forced.lower())
    found = {"evaluate": {
        "m_full": {"speed": {"sgemm_peak_gflop_per_s": 247.1,
                             "openblas": {"core": "Haswell", "forced": "Haswell"}}},
        "m_paper": {"speed": {"sgemm_peak_gflop_per_s": 441.9,
                              "openblas": {"core": "SkylakeX", "forced": None}}},
        "m_lora": {"speed": {"sgemm_peak_gflop_per_s": 440.0}},  # no OpenBLAS in its step
        "m_bitfit": None}}
    assert openblas_lines(list(found["evaluate"]), found) == [
        "OpenBLAS's kernels in each run: m_full: Haswell, forced by OPENBLAS_CORETYPE=Haswell "
        "(sgemm peak 247 GFLOP/s); m_paper: SkylakeX, OpenBLAS's choice for this CPU "
        "(sgemm peak 442 GFLOP/s).", ""]
    assert openblas_lines(["m_lora"], found) == []


def test_the_profile_reads_the_products_gflops_against_the_sgemm_peak():
    from pipelines.evaluate.kernel_profile import products

    # (symbol, seconds, FLOPs) per call, as the native runner gives them
    calls = [("pockengine_sgemm_nt_bf16", 0.002, 1e9), ("fused_add", 0.001, 0),
             ("pockengine_sgemm_nt_bf16", 0.002, 1e9), ("pockengine_sgemm_tn", 0.001, 0.2e9)]
    found = products(calls)
    assert found["calls_per_step"] == 3 and found["gflop_per_step"] == pytest.approx(2.2)
    assert found["gflop_per_s"] == pytest.approx(2.2 / 0.005)
    assert found["functions"]["pockengine_sgemm_nt_bf16"]["gflop_per_s"] == pytest.approx(500)
    found.update(sgemm_peak_gflop_per_s=400.0, sgemm_peak_before_after=[400.0, 371.2],
                 openblas={"core": "SkylakeX", "forced": None})
    lines = product_lines(found)
    assert lines[0] == ("Its matrix products: 3 calls a step, 2.20 GFLOP in 5.00 ms, 440 GFLOP/s "
                        "(110% of the peak), against the sgemm peak of 400 GFLOP/s on the host's "
                        "cores (the higher of 400 before the profile and 371 after); OpenBLAS's "
                        "kernels: SkylakeX, OpenBLAS's choice for this CPU:")
    assert "| `pockengine_sgemm_tn` | 1 | 0.20 | 1.00 | 200 GFLOP/s (50% of the peak) |" in lines
    assert product_lines(products([("fused_add", 0.001, 0)])) == []
    assert product_lines(None) == []  # a profile written before products were counted

