"""tune@<case> (the host) and device_tune@<case>-<device>: tuned schedules for the kernels of
the step the device builds (pipelines/backend/tune_step.py): the committed records of
device_profiles/tuned/<device>/ it matches, improved by the profile's ``tune.trials`` of
MetaSchedule here (0 in every shipped profile).

Output (artifacts/cases/<case>/<device>/tune/): workloads.json and records.json, a MetaSchedule
database the build applies; metrics.json (kernels, how many have a tuned schedule; after
tuning, per kernel its default and tuned times).
"""
import sys

from pipelines.backend.tune_step import tune_step
from pipelines.backend.tuning import PRETUNED
from pipelines.compile import optimized_for
from pipelines.config import run_stage
from pipelines.io import ROOT, atomic_dir, write_json_atomic, write_manifest
from pipelines.ir import load_ir
from pipelines.layout import case_dir, device_dir
from pipelines.profiles import resolved_profile, tvm_target


def main(name: str, device: str) -> None:
    profile = resolved_profile(device)
    step, _ = optimized_for(profile, case_dir(name, "optimize"))
    committed = ROOT / PRETUNED / device
    with atomic_dir(device_dir(name, device, "tune")) as tmp:
        metrics = tune_step(load_ir(step), tvm_target(profile), profile["tune"]["trials"],
                            profile["cores"], committed, tmp, profile["tune"]["seed"],
                            f"tune@{name}-{device}")
        write_json_atomic(tmp / "metrics.json", metrics)
        write_manifest(tmp, f"tune@{name}-{device}", {"step": step, "pretuned": committed},
                       {"profile": profile})
    print(f"tune@{name}-{device}: {metrics['tuned_kernels']} of {metrics['kernels']} kernels "
          "have a tuned schedule")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1], sys.argv[2]))
