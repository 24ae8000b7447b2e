"""What evaluate@<case> measures for one case built for the host, as its ``evaluate`` list asks:

- speed: the compiled step against the PyTorch peers in one run (speed.py), and its first
  steps' losses against PyTorch's on the same batch;
- finetune: fine-tuning on the model's data, PyTorch beside it (finetune.py).

Plus what the chain already knows of the case: what its scheme removes (the prune report) and
its planned memory. Nothing is written here: the stage writes the result.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.data import timing_batch
from pipelines.evaluate.finetune import CHECKED_STEPS, LOSS_RTOL, Finetuned, finetune
from pipelines.evaluate.speed import Spec, measure
from pipelines.evaluate.twin import step_batch, torch_twin
from pipelines.io import save_arrays
from pipelines.runtime.step import CompiledStep, selection_of

COST_KEYS = ("ops", "flops", "backward_flops", "param_grad_bytes", "optimizer_state_bytes",
             "saved_activation_bytes")


@dataclass
class Evaluation:
    metrics: dict
    finetuned: Finetuned | None


def synthetic_batch(signature: dict, seed: int, batches: int = 1) -> tuple[np.ndarray, ...]:
    """Seeded data of the step's inputs' shapes, ``batches`` batches along the first axis:
    normal floats, zero integers (valid token ids and labels), an attention mask of ones (no
    position masked). What a step is run on where its numbers, not its data, are checked (a
    device against the host, a packaged image)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for name in signature["data"]:  # the step's order
        t = signature["data_types"][name]
        shape = [t["shape"][0] * batches, *t["shape"][1:]]
        fill = np.ones if name == "attention_mask" else np.zeros
        arrays.append(rng.standard_normal(shape).astype(t["dtype"]) if "float" in t["dtype"]
                      else fill(shape, t["dtype"]))
    return tuple(arrays)


def batch_for(signature: dict, model, data: dict | None, seed: int) -> tuple[np.ndarray, ...]:
    """The batch a step is timed on: the first of the model's training data, or a synthetic
    one for a model without data."""
    if data is None:
        return synthetic_batch(signature, seed)
    return step_batch(signature, *timing_batch(data, model.batch_size, signature["data"][:-1]))


def cost_summary(report: dict) -> dict:
    """The prune report's figures that a table of cases compares: this scheme's over full BP."""
    pruned, full = report["pruned"], report["full"]
    return {"trainable_elements": pruned["trainable_elements"],
            "trainable_fraction": pruned["trainable_elements"] / full["trainable_elements"],
            "channel_sparse_parameters": len(report["channel_sparse"]),
            **{f"{k}_vs_full": pruned[k] / full[k] if full[k] else None for k in COST_KEYS},
            **{k: pruned[k] for k in ("param_grad_bytes", "optimizer_state_bytes",
                                      "saved_activation_bytes")}}


def first_losses(model, build: Path, initial: dict, optimizer, *batch) -> tuple[list, list]:
    """The compiled step's and PyTorch's losses over the first steps on one batch (the model's
    inputs, then the labels; the second step reads the first one's update)."""
    from pipelines.models.torch_twin import make_optimizer, train_step

    compiled = CompiledStep(build, initial)
    twin = torch_twin(model, compiled.signature, initial)
    update = make_optimizer(twin, optimizer, selection_of(compiled.signature))
    return ([compiled.step(*batch) for _ in range(CHECKED_STEPS)],
            [train_step(twin, update, *batch, task=compiled.signature["task"])
             for _ in range(CHECKED_STEPS)])


def evaluate_case(name: str, case, model, optimizer, benchmark, cores: int, build: Path,
                  initial: dict, data: dict | None, report: dict, plan: dict,
                  seed: int, lora=None) -> Evaluation:
    """The case's metrics (and its fine-tuning run): ``case``, ``model``, ``optimizer``,
    ``benchmark`` are pipelines/config.py sections; ``build`` the host build, ``initial`` its
    initial state, ``data`` the model's arrays (None: none), ``report`` the prune report,
    ``plan`` the build's memory plan."""
    signature = CompiledStep(build, initial).signature
    metrics = {"case": name, "model": case.model, "scheme": case.scheme,
               "optimizer": case.optimizer, "cost": cost_summary(report),
               "plan": {"planned_peak_bytes": plan["planned_peak_bytes"],
                        "recomputed": plan["recomputed"]}}
    torch_model = model.in_pytorch
    if "speed" in case.evaluate:
        batch = batch_for(signature, model, data, seed)
        if torch_model:  # a wrong build fails here, before anything is timed
            compiled, pytorch = first_losses(model, build, initial, optimizer, *batch)
            if not np.allclose(compiled, pytorch, rtol=LOSS_RTOL, atol=0):
                raise RuntimeError(f"{name}: the compiled step's losses {compiled} are not "
                                   f"PyTorch's {pytorch} (rtol {LOSS_RTOL})")
            metrics["losses"] = {"compiled": compiled, "pytorch": pytorch}
        with tempfile.TemporaryDirectory(prefix="pock-evaluate-") as tmp:
            save_arrays(Path(tmp) / "batch.npz", dict(zip(signature["data"], batch)))
            spec = Spec(cores, benchmark.warmup, benchmark.steps, Path(tmp) / "batch.npz",
                        build, initial, model, optimizer, benchmark.rounds,
                        benchmark.min_seconds)
            peers = list(benchmark.peers) if torch_model else []
            metrics["speed"] = measure(spec, peers, report)
    finetuned = None
    if "finetune" in case.evaluate:
        finetuned = finetune(model, build, initial, optimizer, data, model.finetune.epochs,
                             seed, lora, name)
        metrics["finetune"] = finetuned.metrics
    return Evaluation(metrics, finetuned)
