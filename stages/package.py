"""package@<case>-<device>: a Docker image that fine-tunes the case's model on the device: its
build, starting weights and the native runner on TVM's runtime library, no Python
(pipelines/runtime/package.py), tried within the device's cores and memory (or under qemu) on
``package.trial_steps`` seeded batches, beside the Python runner on the same batches.

Output: artifacts/cases/<case>/<device>/package/ (runner/, the native runner and TVM's runtime
libraries; app.tar, the application layer; image.json, the image's ID, tag, layers and how to
run it); artifacts/metrics/package/<case>-<device>.json (the trial's verdict, and for both
runners time per step, peak memory and image size).
"""
import sys

from pipelines.runtime.package import package
from pipelines.io import atomic_dir, write_json_atomic
from pipelines.layout import case_dir, device_dir, metrics_path
from pipelines.phases import TrainingStep
from pipelines.profiles import resolved_profile
from pipelines.resolve import case_inputs
from pipelines.stage import run_stage


def main(name: str, device: str) -> None:
    inputs = case_inputs(name, "package")
    with atomic_dir(device_dir(name, device, "package")) as tmp:
        metrics = package(name, device, resolved_profile(device),
                          device_dir(name, device, "build"), device_dir(name, "host", "build"),
                          TrainingStep.load_initial(case_dir(name, "autodiff")),
                          inputs.trial_steps, inputs.seed, tmp)
    write_json_atomic(metrics_path("package", f"{name}-{device}"), metrics)
    print(f"package@{name}-{device}: {metrics['image']}\n  {metrics['run']}\n  trial: "
          f"{metrics['trial']['verdict']}")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], sys.argv[2])
