"""build@<case> (the host) and device_build@<case>-<device>: the case's optimized step compiled
for the device's profile (pipelines/compile.py: build; backend/build.py).

Output (artifacts/cases/<case>/<device>/build/): step.so (or step.tar, objects the device
links), signature.json, plan.json (the planned memory of the step built), manifest.json
(target, toolchain, size, kernel schedules, backends, whether activations are recomputed), also
artifacts/metrics/build/<case>-<device>.json. A
step over the profile's memory budget takes the recomputing twin where that fits, and is
refused otherwise; a missing cross compiler or nvcc is refused before compiling.
"""
import sys

from pipelines.backend.tuning import open_database
from pipelines.compile import build, optimized_for
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.ir import load_ir
from pipelines.layout import case_dir, device_dir, metrics_path
from pipelines.config import run_stage
from pipelines.profiles import resolved_profile


def main(name: str, device: str) -> None:
    profile = resolved_profile(device)
    step, planned = optimized_for(profile, case_dir(name, "optimize"))
    tuned = device_dir(name, device, "tune")
    with atomic_dir(device_dir(name, device, "build")) as tmp:
        built = build(load_ir(step), profile, tmp, open_database(tuned))
        write_json_atomic(tmp / "plan.json", planned)
        write_manifest(tmp, f"build@{name}-{device}", {"step": step, "tuning": tuned},
                       {"profile": profile, **built, "recomputed": planned["recomputed"]})
    write_json_atomic(metrics_path("build", f"{name}-{device}"),
                      {**built, "recomputed": planned["recomputed"],
                       "planned_peak_bytes": planned["planned_peak_bytes"]})
    print(f"build@{name}-{device}: {built['library']} ({built['library_bytes'] / 2**20:.2f} MiB)"
          + (", recomputing cheap activations to fit its memory budget"
             if planned["recomputed"] else ""))


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1], sys.argv[2]))
