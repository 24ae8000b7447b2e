"""benchmark@<case>-<device>: the case's build for a device, run where the profile's runner
reaches it (pipelines/evaluate/device.py; pipelines/runtime/runners): over TVM RPC, under qemu,
in a container limited to the device's cores and memory, or here; one step on the seeded batch
reference@ ran the host build on, checked against its outputs, then timed. A runner of none
records why nothing ran. In a container, the PyTorch peers the profile names train the same case
in the same limits after it.

Output: artifacts/metrics/benchmark/<case>-<device>.json (DVC metrics). A step that does not
match the host build's is recorded, and the stage fails.
"""
import sys

from pipelines.runtime.step import synthetic_batch
from pipelines.evaluate.device import run_on_device, summary
from pipelines.runtime.agreement import CHANGE_RTOL, RTOL
from pipelines.io import write_json_atomic
from pipelines.layout import case_dir, device_dir, metrics_path
from pipelines.phases import Build, Reference, TrainingStep
from pipelines.profiles import resolved_profile
from pipelines.resolve import case_inputs
from pipelines.schema import HOST
from pipelines.stage import run_stage


def main(name: str, device: str) -> None:
    inputs, build = case_inputs(name, "measure"), device_dir(name, device, "build")
    signature = Build.load(build).signature
    metrics = run_on_device(device, resolved_profile(device), build,
                            TrainingStep.load_initial(case_dir(name, "autodiff")),
                            synthetic_batch(signature, inputs.seed),
                            Reference.load(device_dir(name, HOST, "reference")).ordered(signature),
                            inputs.benchmark.warmup, inputs.benchmark.steps, inputs.model,
                            inputs.optimizer)
    write_json_atomic(metrics_path("benchmark", f"{name}-{device}"), metrics)
    print(summary(metrics))
    if metrics.get("matches_host") is False:  # recorded, and the stage fails: a wrong build
        sys.exit(f"error: {device}'s step does not match the host build's (worst output "
                 f"{metrics['worst_diff_over_tolerance']:.1f}x over rtol {RTOL}; an updated "
                 f"tensor's change {metrics['worst_change_error']:.1%} off the host's, allowed "
                 f"{CHANGE_RTOL:.0%})")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], sys.argv[2])
