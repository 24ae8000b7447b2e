"""profile@<case>: the case's host build run on seeded batches of its shapes by the native
runner: where its time goes, every VM call timed, by phase (forward, backward, update) and by
kind (pipelines/evaluate/kernel_profile.py); and its outputs after one step, the reference each
device's build of the case is checked against (benchmark@).

Output: artifacts/metrics/profile/<case>.json (the report's "Where the time goes");
artifacts/cases/<case>/host/reference/outputs.npz.
"""
import sys

from pipelines.runtime.step import synthetic_batch
from pipelines.evaluate.kernel_profile import kernel_profile, reference_outputs
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.layout import case_dir, device_dir, metrics_path, resolved_case
from pipelines.phases import Build, Reference, TrainingStep
from pipelines.profiles import resolved_profile
from pipelines.resolve import case_inputs
from pipelines.schema import HOST
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, build = case_inputs(name, "measure"), device_dir(name, HOST, "build")
    initial = TrainingStep.load_initial(case_dir(name, "autodiff"))
    batch = synthetic_batch(Build.load(build).signature, inputs.seed)
    with atomic_dir(device_dir(name, HOST, "reference")) as tmp:
        Reference(reference_outputs(build, initial, batch)).save(tmp)
        write_manifest(tmp, f"profile@{name}", {"build": build,
                                                "inputs": resolved_case(name, "measure")}, {})
    warmup, steps = inputs.benchmark.warmup, inputs.benchmark.steps
    batches = synthetic_batch(Build.load(build).signature, inputs.seed, warmup + steps)
    result = kernel_profile(build, initial, batches, resolved_profile(HOST), warmup, steps)
    write_json_atomic(metrics_path("profile", name), result)
    print(f"profile@{name}: {result['calls_per_step']} calls per step, "
          f"{result['kernel_time_ms']:.2f} ms in calls")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
