"""scheme_search: choose what to update under a memory budget (method: stages/search/search.py).

Outputs (artifacts/search/): scheme.yaml, a scheme for conf/sparse (`pock scheme search` writes
it there too), and contributions.json, one row per candidate: layer, channel ratio, loss drop,
memory cost, chosen.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch
import yaml

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic, write_text_atomic
from pipelines.config import CONF, load_params, require, run_stage
from pipelines.ir import load_ir
from stages.search.search import Probe, search

OUT = ARTIFACTS / "search"
AUTODIFF = ARTIFACTS / "autodiff"


def run(params: dict, budget_mb: float, name: str) -> tuple[dict, dict]:
    cfg = require(params, "search")
    layers = json.loads((ARTIFACTS / "import" / "layers.json").read_text())
    signature = json.loads((AUTODIFF / "signature.json").read_text())
    full = load_ir(AUTODIFF / "train_step.json")["train_step"]
    probe = Probe(require(params, "model"), require(params, "optimizer"),
                  torch.load(ARTIFACTS / "pretrain" / "weights.pt", weights_only=True),
                  np.load(ARTIFACTS / "data" / "digits.npz"), layers, int(cfg["steps"]),
                  int(require(params, "seed")))
    return search(cfg, budget_mb, probe, layers, full, signature, name,
                  log=lambda line: print(line, flush=True))


def scheme_yaml(scheme: dict, table: dict) -> str:
    chosen = [r for r in table["candidates"] if r["chosen"]]
    header = (f"# Found by `pock scheme search --budget-mb {table['budget_mb']:g}` "
              f"(stages/search/search.py): {len(chosen)} layers chosen by loss drop per byte;\n"
              f"# gradients + optimizer state + saved activations: "
              f"{table['chosen_cost_bytes'] / 2**20:.3f} MiB.\n")
    return header + yaml.safe_dump(scheme, sort_keys=False)


def main() -> None:
    params = load_params()
    cfg = require(params, "search")
    budget, name = float(require(params, "search.budget_mb")), str(cfg["name"])
    scheme, table = run(params, budget, name)
    with atomic_dir(OUT) as tmp:
        write_text_atomic(tmp / "scheme.yaml", scheme_yaml(scheme, table))
        write_json_atomic(tmp / "contributions.json", table)
    rows = table["candidates"]
    print(f"scheme {name}: {sum(r['chosen'] for r in rows)} of {len(rows)} candidates chosen "
          f"under {budget:g} MiB; written to {OUT / 'scheme.yaml'}")


def cli(budget_mb: float | None, name: str | None) -> None:
    """`pock scheme search`: the same search; the scheme goes to conf/sparse/<name>.yaml."""
    params = load_params()
    budget = float(budget_mb if budget_mb is not None else require(params, "search.budget_mb"))
    name = name or str(require(params, "search.name"))
    scheme, table = run(params, budget, name)
    target = CONF / "sparse" / f"{name}.yaml"
    write_text_atomic(target, scheme_yaml(scheme, table))
    rows = table["candidates"]
    print(f"\nbase loss {table['base_loss']:.4f}\n{'layer':<24}{'ratio':>6}{'loss drop':>11}{'cost KiB':>10}  chosen")
    for row in sorted(rows, key=lambda r: -r["contribution"]):
        print(f"{row['module']:<24}{row['ratio']:>6g}{row['contribution']:>+11.4f}"
              f"{row['cost_bytes'] / 2**10:>10.1f}  {'yes' if row['chosen'] else ''}")
    print(f"\nwrote {target}; use it with `pock compose sparse={name}`", file=sys.stderr)


if __name__ == "__main__":
    run_stage(main)
