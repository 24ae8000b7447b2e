"""optimize@<case>: graph optimizations of the pruned step and its planned peak memory
(pipelines/compile.py: optimize, plan), with the case's ``optimize`` settings.

Output (artifacts/cases/<case>/optimize/): train_step.relax.py / .json (updates reordered when
``reorder_updates``, cheap activations recomputed when ``recompute`` is always, fused) and
plan.json, also artifacts/metrics/optimize/<case>.json; with ``recompute`` auto also
train_step_recompute.*, the twin a device build takes when only it fits its memory budget (its
plan under plan.json's ``recompute``).
"""
import sys

from pipelines.compile import optimize, plan
from pipelines.config import case_optimize, load_params, run_stage
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.ir import load_ir, save_ir
from pipelines.layout import case_dir, metrics_path


def main(name: str) -> None:
    params = load_params()
    settings = case_optimize(params, params.cases[name])
    pruned = load_ir(case_dir(name, "prune") / "train_step.json")
    always = settings.recompute == "always"
    step = optimize(pruned, settings.reorder_updates, always)
    planned = plan(step) | {"reorder_updates": settings.reorder_updates,
                            "recomputed": always, "recompute": None}
    twin = optimize(pruned, settings.reorder_updates, True) if settings.recompute == "auto" else None
    if twin is not None:
        planned["recompute"] = plan(twin) | {"recomputed": True}
    with atomic_dir(case_dir(name, "optimize")) as tmp:
        save_ir(step, tmp, "train_step")
        if twin is not None:
            save_ir(twin, tmp, "train_step_recompute")
        write_json_atomic(tmp / "plan.json", planned)
        write_manifest(tmp, f"optimize@{name}", {"prune": case_dir(name, "prune")},
                       {"optimize": settings.model_dump()})
    write_json_atomic(metrics_path("optimize", name), planned)
    print(f"optimize@{name}: planned peak {planned['planned_peak_bytes'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
