"""What evaluate@<case> measures for one case built for the host, as its ``evaluate`` list asks:

- speed: the compiled step against its peers in one run (speed.py);
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
from pipelines.evaluate.finetune import (CHECKED_STEPS, Finetuned, check_first_losses, finetune,
                                         over_runs)
from pipelines.evaluate.speed import Spec, in_fresh_process, measure
from pipelines.frontends.twin import step_batch, torch_twin
from pipelines.io import read_json, save_arrays
from pipelines.models.pytorch import lr_scales_of, selection_of
from pipelines.phases import SIGNATURE
from pipelines.runtime.step import CompiledStep, synthetic_batch

COST_KEYS = ("ops", "flops", "backward_flops", "param_grad_bytes", "optimizer_state_bytes",
             "saved_activation_bytes")


@dataclass
class Evaluation:
    metrics: dict
    finetuned: Finetuned | None

    @property
    def curves(self) -> dict[str, list]:
        """The DVC plots: per step the losses, per evaluation the held-out scores (empty lists
        for a case not fine-tuned)."""
        tuned = self.finetuned
        return {"loss": tuned.losses if tuned else [],
                "eval": tuned.evaluations if tuned else []}


def save_finetuned(tuned: Finetuned, model, directory: Path, tokenizer: Path | None = None,
                   classes: list[str] | None = None) -> None:
    """The fine-tuned weights (by the source's names), the optimizer's state as torch.optim's
    (safetensors: frontends/weights.py, load_optimizer_state), a LoRA scheme's export, and for
    a transformers model what its tools load (save_transformers); ``tokenizer``, the data's
    (a save_pretrained directory), saved with it, and ``classes``, its class names by label,
    as the config's id2label."""
    from pipelines.frontends.weights import save_optimizer_state, save_weights

    save_weights(tuned.weights, directory / "weights.safetensors")
    save_optimizer_state(tuned.optimizer_state, directory / "optimizer.safetensors")
    if tuned.export is not None:
        save_weights(tuned.export[1], directory / tuned.export[0])
    if model.frontend == "transformers":
        save_transformers(tuned, model, directory, tokenizer, classes)


def save_transformers(tuned: Finetuned, model, directory: Path, tokenizer: Path | None,
                      classes: list[str] | None = None) -> None:
    """pretrained/ (from_pretrained, LoRA merged, the tokenizer beside it), a LoRA case's
    PEFT adapter/ (with base/, the frozen model, where the source has no weights), and a
    LLaMA or Qwen2 causal LM's model.gguf (pipelines/exports)."""
    import shutil

    from pipelines.exports.gguf_file import ARCHITECTURES, save_gguf
    from pipelines.exports.peft_adapter import save_adapter
    from pipelines.frontends.transformers import (class_of, config_of, has_weights,
                                                  pretrained_module, save_pretrained)
    from pipelines.io import ROOT
    from pipelines.models.torch_lora import SUFFIXES

    plain = tuned.plain_weights
    save_pretrained(model, plain, directory / "pretrained", classes)
    if tokenizer is not None:
        shutil.copytree(tokenizer, directory / "pretrained", dirs_exist_ok=True)
    signature = tuned.step.signature
    lora = signature.get("lora")
    if lora is not None:
        frozen = {k: v for k, v in tuned.weights.items() if not k.endswith(SUFFIXES)}
        if not has_weights(ROOT / model.source):
            save_pretrained(model, frozen, directory / "base", classes)
            if tokenizer is not None:
                shutil.copytree(tokenizer, directory / "base", dirs_exist_ok=True)
        save_adapter(pretrained_module(model, frozen), tuned.weights, lora["rank"],
                     lora["rank"] * lora["scale"], list(selection_of(signature)),
                     signature["task"], model.source, directory / "adapter")
    config = config_of(model)
    architecture = class_of(model, config).__name__
    if architecture in ARCHITECTURES:
        save_gguf(config, architecture, plain, tokenizer, directory / "model.gguf")


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
    inputs, then the labels; the second step reads the first one's update), each step
    ``optimizer.gradient_accumulation_steps`` calls of the compiled step."""
    from pipelines.models.pytorch import accumulated_step, make_optimizer

    calls = optimizer.gradient_accumulation_steps
    compiled = CompiledStep(build, initial)
    signature, ours = compiled.signature, [compiled.step(*batch)
                                           for _ in range(CHECKED_STEPS * calls)]
    del compiled  # one side's state at a time (Qwen2.5-0.5B's full BP: 8 GB each)
    twin = torch_twin(model, signature, initial)
    update = make_optimizer(twin, optimizer, selection_of(signature), lr_scales_of(signature))
    return ours, [loss for _ in range(CHECKED_STEPS) for loss in accumulated_step(
        twin, update, [batch] * calls, signature["task"])]


def evaluate_case(inputs, cores: int, build: Path, initial: dict, data: dict | None,
                  report: dict, plan: dict, checkpoints: Path | None = None) -> Evaluation:
    """The case's metrics (and its fine-tuning run): ``inputs`` what the resolve stage gives
    evaluate@ (pipelines/resolve.py: EvaluateInputs); ``build`` the host build, ``initial``
    its initial state, ``data`` the model's arrays (None: none), ``report`` the prune report,
    ``plan`` the build's memory plan; ``checkpoints``, where fine-tuning keeps its last
    checkpoint and goes on from one.

    A wrong build fails before anything is timed: its first steps' losses must be PyTorch's,
    checked once, by fine-tuning where the case fine-tunes, else on the timing batch."""
    model, optimizer = inputs.model, inputs.optimizer
    signature = read_json(Path(build) / SIGNATURE)
    metrics = {"case": inputs.case, "model": inputs.model_name, "scheme": inputs.scheme,
               "optimizer": inputs.optimizer_name, "cost": cost_summary(report),
               "plan": {"planned_peak_bytes": plan["planned_peak_bytes"],
                        "recomputed": plan["recomputed"]}}
    finetuned = None
    if "finetune" in inputs.evaluate:
        def run(k: int) -> Finetuned:
            """Run k of finetune.runs: its batches shuffled with seed + k, its checkpoints its
            own (the first run's where a single run keeps them)."""
            kept = checkpoints / f"run-{k + 1}" if checkpoints and k else checkpoints
            return finetune(model, build, initial, optimizer, data, model.finetune.epochs,
                            inputs.seed + k, inputs.lora,
                            inputs.case + (f" run {k + 1}" if k else ""), kept,
                            model.finetune.checkpoint_every)
        finetuned = run(0)
        metrics["finetune"] = finetuned.metrics
        if model.finetune.runs > 1:  # the others' metrics only: the first run's weights stand
            seeds = [inputs.seed + k for k in range(model.finetune.runs)]
            metrics["finetune"]["runs"] = over_runs(
                seeds, [finetuned.metrics] + [run(k).metrics for k in range(1, len(seeds))])
        checked = finetuned.losses[:CHECKED_STEPS]
        metrics["losses"] = {side: [r[side] for r in checked] for side in ("compiled", "pytorch")}
    if "speed" in inputs.evaluate:
        batch = batch_for(signature, model, data, inputs.seed)
        if model.in_pytorch and finetuned is None:
            # in a process of its own, whose memory (the compiled step's and PyTorch's state,
            # Qwen2.5-0.5B's full BP: 15 GB) is gone before the timed processes start
            compiled, pytorch = in_fresh_process(first_losses, model, build, initial, optimizer,
                                                 *batch)
            check_first_losses(inputs.case, compiled, pytorch)
            metrics["losses"] = {"compiled": compiled, "pytorch": pytorch}
        with tempfile.TemporaryDirectory(prefix="pock-evaluate-") as tmp:
            save_arrays(Path(tmp) / "batch.npz", dict(zip(signature["data"], batch)))
            spec = Spec(cores, inputs.benchmark.warmup, inputs.benchmark.steps,
                        Path(tmp) / "batch.npz", build, initial, model, optimizer,
                        inputs.benchmark.rounds, inputs.benchmark.min_seconds)
            peers = list(inputs.benchmark.peers) if model.in_pytorch else []
            metrics["speed"] = measure(spec, peers, report)
    return Evaluation(metrics, finetuned)
