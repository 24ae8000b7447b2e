"""The report's GPU section (pipelines/report/render.py): each committed `pock gpu bench` run
rendered as a table, a case that failed on the GPU said so with its error, nothing dropped."""
from pipelines.report.render import gpu_tables


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
