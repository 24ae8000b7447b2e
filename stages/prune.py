"""prune@<case>: the case's scheme applied to its full training step (pipelines/compile.py:
sparse_update); a scheme with a ``search`` section first finds its rules
(pipelines/evaluate/search.py).

Output (artifacts/cases/<case>/prune/): train_step.relax.py / .json, the pruned step (only the
scheme's parameters and channels updated); signature.json; scheme.yaml, the rules applied (for
a search: the ones it found). artifacts/metrics/prune/<case>.json: what the scheme removes
from full backpropagation (ops, FLOPs, gradient, state and saved-activation bytes; for a
search, every candidate measured).
"""
import sys

import yaml

from pipelines.analysis.cost import scheme_report
from pipelines.compile import sparse_update
from pipelines.config import case_optimizer, load_params, run_stage
from pipelines.data import FILE as DATA
from pipelines.evaluate.search import search_rules
from pipelines.frontends.weights import FILE as WEIGHTS
from pipelines.io import atomic_dir, read_json, write_json_atomic, write_manifest, write_text_atomic
from pipelines.ir import load_ir, save_ir
from pipelines.layout import case_dir, metrics_path, model_dir
from pipelines.training.scheme import select


def main(name: str) -> None:
    params = load_params()
    case, full_dir = params.cases[name], case_dir(name, "autodiff")
    scheme, full = params.schemes[case.scheme], load_ir(full_dir / "train_step.json")
    layers = read_json(full_dir / "layers.json")
    rules, table = scheme.rules, None
    if scheme.search:
        rules, table = search_rules(
            scheme.search, params.models[case.model], case_optimizer(params, case),
            model_dir(case.model, "weights") / WEIGHTS, model_dir(case.model, "data") / DATA,
            layers, full, params.seed)
    pruned = sparse_update(full, select(rules, layers), case.scheme)
    report = scheme_report(full, pruned)
    with atomic_dir(case_dir(name, "prune")) as tmp:
        save_ir(pruned, tmp, "train_step")
        write_text_atomic(tmp / "scheme.yaml", yaml.safe_dump(
            {"rules": [r if isinstance(r, dict) else r.model_dump(exclude_none=True)
                       for r in rules]}, sort_keys=False))
        write_manifest(tmp, f"prune@{name}", {"autodiff": full_dir},
                       {"scheme": scheme.model_dump()})
    write_json_atomic(metrics_path("prune", name), report | ({"search": table} if table else {}))
    print(f"prune@{name}: {report['trainable_parameters']} parameters trainable "
          f"({len(report['channel_sparse'])} on some channels); removed "
          f"{report['removed_fraction']['backward_flops']:.1%} of backward FLOPs")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
