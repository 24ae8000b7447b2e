"""profile@<case>: the case's host build run on seeded batches of its shapes by the native
runner: where its time goes, every VM call timed, by phase (forward, backward, update) and by
kind (pipelines/evaluate/kernel_profile.py); and its matrix products' GFLOP/s against the sgemm
peak on the host's cores (the measured ceiling they are read against, as evaluate@ reads the
whole step), with the OpenBLAS kernels they ran. The peak is measured before the profile and
after it, and the higher of the two is the yardstick: on a shared machine it moves by a
quarter within minutes (docs/llm.md), and a low one would flatter the products.

Output: artifacts/metrics/profile/<case>.json (the report's "Where the time goes").
"""
import sys

from pipelines.evaluate.kernel_profile import kernel_profile
from pipelines.evaluate.speed import in_fresh_process, openblas_kernels, sgemm_peak
from pipelines.io import write_json_atomic
from pipelines.layout import case_dir, device_dir, metrics_path
from pipelines.phases import Build, TrainingStep
from pipelines.profiles import resolved_profile
from pipelines.resolve import case_inputs
from pipelines.runtime.step import synthetic_batch
from pipelines.schema import HOST
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, build = case_inputs(name, "measure"), device_dir(name, HOST, "build")
    host = resolved_profile(HOST)
    initial = TrainingStep.load_initial(case_dir(name, "autodiff"))
    warmup, steps = inputs.benchmark.warmup, inputs.benchmark.steps
    batches = synthetic_batch(Build.load(build).signature, inputs.seed, warmup + steps)
    before = in_fresh_process(sgemm_peak, host.cores)
    result = kernel_profile(build, initial, batches, host, warmup, steps)
    del initial, batches
    after = in_fresh_process(sgemm_peak, host.cores)
    products, peak = result["products"], max(before, after)
    products.update(sgemm_peak_gflop_per_s=peak, sgemm_peak_before_after=[before, after],
                    fraction_of_sgemm_peak=(products["gflop_per_s"] / peak
                                            if products["gflop_per_s"] else None))
    if openblas := in_fresh_process(openblas_kernels, build):
        products["openblas"] = openblas
    write_json_atomic(metrics_path("profile", name), result)
    print(f"profile@{name}: {result['calls_per_step']} calls per step, "
          f"{result['kernel_time_ms']:.2f} ms in calls; products "
          f"{products['gflop_per_step']:.2f} GFLOP in {products['ms_per_step']:.2f} ms")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
