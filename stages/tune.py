"""tune@<case> (the host) and device_tune@<case>-<device>: which variant of the optimized step
the device builds (the one its memory budget holds: pipelines/profiles.py, variant_for), and
tuned schedules for its kernels (pipelines/backend/tune_step.py): the committed records of
device_profiles/tuned/<device>/ it matches (as the resolve stage copied them), improved by the profile's ``tune.trials`` of
MetaSchedule here (0 in every shipped profile).

Output (artifacts/cases/<case>/<device>/tune/, a phases.Tuning): workloads.json and
records.json, a MetaSchedule database the build applies; metrics.json (the variant, kernels,
how many have a tuned schedule; after tuning, per kernel its default and tuned times).
"""
import sys

from pipelines.backend.tune_step import tune_step
from pipelines.io import atomic_dir, write_manifest
from pipelines.layout import case_dir, device_dir, resolved_pretuned, resolved_profile_path
from pipelines.phases import OptimizedStep, Tuning
from pipelines.profiles import resolved_profile, tvm_target, variant_for
from pipelines.stage import run_stage


def main(name: str, device: str) -> None:
    profile, optimized = resolved_profile(device), case_dir(name, "optimize")
    variant = variant_for(OptimizedStep.load_plan(optimized), profile)
    step, _ = OptimizedStep.load_variant(optimized, variant)
    committed = resolved_pretuned(device)
    with atomic_dir(device_dir(name, device, "tune")) as tmp:
        metrics = tune_step(step, tvm_target(profile), profile.tune.trials, profile.cores,
                            committed, tmp, profile.tune.seed, f"tune@{name}-{device}")
        Tuning(tmp, variant, metrics).save()
        write_manifest(tmp, f"tune@{name}-{device}", {
            "optimize": optimized, "pretuned": committed,
            "profile": resolved_profile_path(device)}, {})
    print(f"tune@{name}-{device}: {metrics['tuned_kernels']} of {metrics['kernels']} kernels "
          f"have a tuned schedule" + (" (recomputing variant)" if variant == "recompute" else ""))


if __name__ == "__main__":
    run_stage(main, sys.argv[1], sys.argv[2], phase="tune")
