"""prune@<case>: the case's scheme applied to its full training step (pipelines/compile.py:
sparse_update); a scheme with a ``search`` section first finds its rules
(pipelines/search.py).

Output (artifacts/cases/<case>/prune/, a phases.PrunedStep): train_step.relax.py / .json, the
pruned step (only the scheme's parameters and channels updated); signature.json; scheme.yaml,
the rules applied (for a search: the ones it found). artifacts/metrics/prune/<case>.json: what
the scheme removes from full backpropagation (ops, FLOPs, gradient, state and saved-activation
bytes; for a search, every candidate measured).
"""
import sys

from pipelines.compile import sparse_update
from pipelines.data import FILE as DATA
from pipelines.search import search_rules
from pipelines.frontends.weights import FILE as WEIGHTS
from pipelines.io import atomic_dir, write_json_atomic, write_manifest
from pipelines.layout import case_dir, metrics_path, model_dir, resolved_case
from pipelines.phases import TrainingStep
from pipelines.resolve import case_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, full_dir = case_inputs(name, "prune"), case_dir(name, "autodiff")
    full, rules, table = TrainingStep.load(full_dir), inputs.rules, None
    if inputs.search:
        rules, table = search_rules(
            inputs.search, inputs.search_model, inputs.optimizer,
            model_dir(inputs.model, "weights") / WEIGHTS, model_dir(inputs.model, "data") / DATA,
            full.layers, full.module, inputs.seed)
    pruned = sparse_update(full, rules, inputs.scheme)
    with atomic_dir(case_dir(name, "prune")) as tmp:
        pruned.save(tmp)
        write_manifest(tmp, f"prune@{name}", {"autodiff": full_dir,
                                              "inputs": resolved_case(name, "prune")}, {})
    report = pruned.report
    write_json_atomic(metrics_path("prune", name), report | ({"search": table} if table else {}))
    print(f"prune@{name}: {report['trainable_parameters']} parameters trainable "
          f"({len(report['channel_sparse'])} on some channels); removed "
          f"{report['removed_fraction']['backward_flops']:.1%} of backward FLOPs")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], phase="prune")
