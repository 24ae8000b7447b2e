"""build@<case> (the host) and device_build@<case>-<device>: the variant of the case's optimized
step the tune stage chose for the device, compiled for its profile with the tuned schedules
(pipelines/compile.py: build; backend/build.py).

Output (artifacts/cases/<case>/<device>/build/, a phases.Build): step.so (or step.tar, objects
the device links), signature.json, plan.json (the planned memory of the step built), build.json
(target, toolchain, size, kernel schedules, backends), also
artifacts/metrics/build/<case>-<device>.json. A missing cross compiler or nvcc is refused
before compiling.
"""
import sys

from pipelines.backend.databases import open_database
from pipelines.compile import build
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.layout import case_dir, device_dir, metrics_path, resolved_profile_path
from pipelines.phases import OptimizedStep, Tuning
from pipelines.profiles import resolved_profile
from pipelines.stage import run_stage


def main(name: str, device: str) -> None:
    profile, optimized = resolved_profile(device), case_dir(name, "optimize")
    tuning = Tuning.load(device_dir(name, device, "tune"))
    step, planned = OptimizedStep.load_variant(optimized, tuning.variant)
    with atomic_dir(device_dir(name, device, "build")) as tmp:
        built = build(step, planned, profile, tmp, open_database(tuning.directory)).built
        write_manifest(tmp, f"build@{name}-{device}", {
            "optimize": optimized, "tune": tuning.directory,
            "profile": resolved_profile_path(device)}, {})
    recomputed = planned["recomputed"]
    write_json_atomic(metrics_path("build", f"{name}-{device}"),
                      {**{k: v for k, v in built.items() if k != "update_kernels"},
                       "recomputed": recomputed,
                       "planned_peak_bytes": planned["planned_peak_bytes"]})
    print(f"build@{name}-{device}: {built['library']} ({built['library_bytes'] / 2**20:.2f} MiB)"
          + (", recomputing cheap activations to fit its memory budget" if recomputed else ""))


if __name__ == "__main__":
    run_stage(main, sys.argv[1], sys.argv[2], phase="build")
