"""optimize@<case>: graph optimizations of the pruned step and its planned peak memory
(pipelines/compile.py: optimize), with the case's ``optimize`` settings.

Output (artifacts/cases/<case>/optimize/, a phases.OptimizedStep): train_step.relax.py / .json
(updates reordered when ``reorder_updates``, cheap activations recomputed when ``recompute`` is
always, a frozen LM head's loss over chunks of ``loss_chunk_rows`` rows, the frozen weights
stored as ``frozen_dtype``, fused, the state updated in its own storage when
``update_in_place``) and plan.json,
also artifacts/metrics/optimize/<case>.json; with ``recompute`` auto and a device that builds
the case whose memory budget the plan exceeds, also
train_step_recompute.*, the twin that recomputes them (its plan under plan.json's
``recompute``).
"""
import sys

from pipelines.compile import optimize
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.layout import case_dir, metrics_path, resolved_case
from pipelines.phases import PrunedStep
from pipelines.resolve import case_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, pruned = case_inputs(name, "optimize"), case_dir(name, "prune")
    optimized = optimize(PrunedStep.load(pruned), inputs.reorder_updates, inputs.recompute,
                         inputs.budgets, inputs.update_in_place, inputs.loss_chunk_rows,
                         inputs.frozen_dtype)
    with atomic_dir(case_dir(name, "optimize")) as tmp:
        optimized.save(tmp)
        write_manifest(tmp, f"optimize@{name}", {"prune": pruned,
                                                 "inputs": resolved_case(name, "optimize")}, {})
    planned = optimized.plan
    write_json_atomic(metrics_path("optimize", name), planned)
    print(f"optimize@{name}: planned peak {planned['planned_peak_bytes'] / 2**20:.2f} MiB"
          + (f"; a recomputing twin for {planned['recompute']['for']}"
             if planned["recompute"] else ""))


if __name__ == "__main__":
    run_stage(main, sys.argv[1], phase="optimize")
