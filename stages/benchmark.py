"""benchmark@<case>-<device>: the case's build for a device, run where the profile's runner
reaches it (pipelines/evaluate/device.py): over TVM RPC, under qemu, in a container limited to
the device's cores and memory, or here; one step on a seeded batch of the step's shapes checked
against the host build's, then timed. A runner of none records why nothing ran.

Output: artifacts/metrics/benchmark/<case>-<device>.json (DVC metrics). A step that does not
match the host build's is recorded, and the stage fails.
"""
import sys

from pipelines.config import HOST, load_params, run_stage
from pipelines.evaluate.case import synthetic_batch
from pipelines.evaluate.device import CHANGE_RTOL, RTOL, run_on_device, summary
from pipelines.io import load_arrays, read_json, write_json_atomic
from pipelines.layout import case_dir, device_dir, metrics_path
from pipelines.profiles import resolved_profile


def main(name: str, device: str) -> None:
    params, host = load_params(), device_dir(name, HOST, "build")
    batch = synthetic_batch(read_json(host / "signature.json"), params.seed)
    metrics = run_on_device(device, resolved_profile(device), device_dir(name, device, "build"),
                            host, load_arrays(case_dir(name, "autodiff") / "initial.npz"), batch,
                            params.benchmark.warmup, params.benchmark.steps)
    write_json_atomic(metrics_path("benchmark", f"{name}-{device}"), metrics)
    print(summary(metrics))
    if metrics.get("matches_host") is False:  # recorded, and the stage fails: a wrong build
        sys.exit(f"error: {device}'s step does not match the host build's (worst output "
                 f"{metrics['worst_diff_over_tolerance']:.1f}x over rtol {RTOL}; an updated "
                 f"tensor's change {metrics['worst_change_error']:.1%} off the host's, allowed "
                 f"{CHANGE_RTOL:.0%})")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1], sys.argv[2]))
