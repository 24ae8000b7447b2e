"""profile@<case>: the case's host build run on seeded batches of its shapes by the native
runner: where its time goes, every VM call timed, by phase (forward, backward, update) and by
kind (pipelines/evaluate/kernel_profile.py); and its matrix products' GFLOP/s against the sgemm
peak on the host's cores (the measured ceiling they are read against, as evaluate@ reads the
whole step), measured before and after it, with the OpenBLAS kernels they ran.

Output: artifacts/metrics/profile/<case>.json (the report's "Where the time goes").
"""
import sys

from pipelines.evaluate.kernel_profile import profile_against_peak
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
    initial = TrainingStep.load_initial(case_dir(name, "autodiff"))
    warmup, steps = inputs.benchmark.warmup, inputs.benchmark.steps
    batches = synthetic_batch(Build.load(build).signature, inputs.seed, warmup + steps)
    result = profile_against_peak(build, initial, batches, resolved_profile(HOST), warmup, steps)
    products = result["products"]
    write_json_atomic(metrics_path("profile", name), result)
    print(f"profile@{name}: {result['calls_per_step']} calls per step, "
          f"{result['kernel_time_ms']:.2f} ms in calls; products "
          f"{products['gflop_per_step']:.2f} GFLOP in {products['ms_per_step']:.2f} ms")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
