"""profile@<case>: where the case's host build spends its time, every VM call timed, by phase
(forward, backward, update) and by kind (pipelines/evaluate/profile.py), on a seeded batch.

Output: artifacts/metrics/profile/<case>.json; the report's "Where the time goes".
"""
import sys

from pipelines.config import HOST, load_params, run_stage
from pipelines.evaluate.case import synthetic_batch
from pipelines.evaluate.profile import kernel_profile
from pipelines.io import load_arrays, read_json, write_json_atomic
from pipelines.ir import load_ir
from pipelines.layout import case_dir, device_dir, metrics_path


def main(name: str) -> None:
    params, build = load_params(), device_dir(name, HOST, "build")
    batch = synthetic_batch(read_json(build / "signature.json"), params.seed)
    result = kernel_profile(build, load_arrays(case_dir(name, "autodiff") / "initial.npz"),
                            batch, load_ir(case_dir(name, "optimize") / "train_step.json"),
                            params.benchmark.warmup, params.benchmark.steps)
    write_json_atomic(metrics_path("profile", name), result)
    print(f"profile@{name}: {result['calls_per_step']} calls per step, "
          f"{result['kernel_time_ms']:.2f} ms in calls")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
