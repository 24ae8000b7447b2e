"""memory: peak memory of the training step, full and sparse: plain, with update reordering,
and reordered with cheap activations recomputed; next to PyTorch eager measured the same way
(host CPU).

Each variant is pruned, (re)ordered, fused and compiled here, then run in a fresh process;
its peak resident memory above that process's baseline is recorded beside TVM's static plan
(and its breakdown). PyTorch eager with full backpropagation and with the scheme's frozen
layers run in fresh processes too, through the same loop (stages/benchmark/cases.py).
Output: artifacts/memory/metrics.json (DVC metrics).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pipelines.artifacts import ARTIFACTS, write_json_atomic
from pipelines.config import load_params, resolved_profile, require, run_stage, tvm_target
from pipelines.ir import load_ir
from pipelines.step import save_step
from stages.benchmark.__main__ import case_spec, run_isolated
from stages.optimize.passes import memory_plan, optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select

AUTODIFF = ARTIFACTS / "autodiff"
LAYERS = ARTIFACTS / "import" / "layers.json"
OUT = ARTIFACTS / "memory" / "metrics.json"


# (case suffix, reorder updates, recompute cheap activations)
VARIANTS = [("plain", False, False), ("reordered", True, False), ("recomputed", True, True)]


def main() -> None:
    params = load_params()
    profile = resolved_profile("host")
    model_cfg, scheme = require(params, "model"), require(params, "sparse")
    signature = json.loads((AUTODIFF / "signature.json").read_text())
    full = load_ir(AUTODIFF / "train_step.json")["train_step"]
    selected = select(scheme, json.loads(LAYERS.read_text()))
    everything = dict.fromkeys(signature["torch_names"][p]
                               for p in signature["inputs"][2:2 + signature["num_params"]])
    spec = case_spec(params, profile, selected)
    results = {}
    scratch = Path(tempfile.mkdtemp(prefix="pock-memory-"))
    try:
        for name, selection in [("full", everything), (scheme["name"], selected)]:
            step, sig, _ = sparse_step(full, signature, selection)  # pruned once per scheme
            for suffix, reorder, recomputed in VARIANTS:
                case = f"compiled_{name}_{suffix}"
                directory = scratch / case
                directory.mkdir()
                mod = optimize(step, sig, reorder, recomputed)
                plan = memory_plan(mod, sig)
                save_step(mod, dict(sig, scheme=name), tvm_target(profile), directory)
                run = run_isolated("compiled", dict(spec, build_dir=str(directory)))
                results[case] = {"peak_rss_bytes": run["peak_rss_bytes"],
                                 "median_ms": run["median_ms"], "plan": plan}
                print(f"{case}: peak RSS +{run['peak_rss_bytes'] / 2**20:.2f} MiB, planned "
                      f"{plan['planned_peak_bytes'] / 2**20:.2f} MiB", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for case in ("torch_eager_full", "torch_eager_frozen"):
        run = run_isolated(case, spec)
        results[case] = {"peak_rss_bytes": run["peak_rss_bytes"], "median_ms": run["median_ms"]}
        print(f"{case}: peak RSS +{run['peak_rss_bytes'] / 2**20:.2f} MiB", flush=True)
    torch_full = results["torch_eager_full"]["peak_rss_bytes"]
    sparse = results[f"compiled_{scheme['name']}_reordered"]["peak_rss_bytes"]
    metrics = {
        "model": model_cfg["name"], "scheme": scheme["name"], **results,
        # The goal: the sparse compiled step at most 1/4 of PyTorch's full-BP peak.
        "sparse_compiled_vs_torch_full_peak": sparse / torch_full if torch_full else None,
    }
    write_json_atomic(OUT, metrics)
    print(f"sparse compiled / PyTorch eager full peak: "
          f"{metrics['sparse_compiled_vs_torch_full_peak']:.3f}")


if __name__ == "__main__":
    run_stage(main)
