"""reference@<case>: a deploy case's host build run for one step on a seeded batch of its
shapes: its outputs, the reference each device's build of the case is checked against
(benchmark@).

Output: artifacts/cases/<case>/host/reference/outputs.npz.
"""
import sys

from pipelines.evaluate.device import reference_outputs
from pipelines.io import atomic_dir, write_manifest
from pipelines.layout import case_dir, device_dir, resolved_case
from pipelines.phases import Build, Reference, TrainingStep
from pipelines.resolve import case_inputs
from pipelines.runtime.step import synthetic_batch
from pipelines.schema import HOST
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, build = case_inputs(name, "measure"), device_dir(name, HOST, "build")
    initial = TrainingStep.load_initial(case_dir(name, "autodiff"))
    batch = synthetic_batch(Build.load(build).signature, inputs.seed)
    with atomic_dir(device_dir(name, HOST, "reference")) as tmp:
        Reference(reference_outputs(build, initial, batch)).save(tmp)
        write_manifest(tmp, f"reference@{name}", {"build": build,
                                                  "inputs": resolved_case(name, "measure")}, {})


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
