"""evaluate@<case>: the case's host build against PyTorch doing the same update, as its
``evaluate`` list asks (pipelines/evaluate/case.py): speed and memory beside its peers in one
run; fine-tuning on the model's data, PyTorch beside it.

Output: artifacts/metrics/evaluate/<case>.json (DVC metrics: what the scheme removes, the plan,
speed, fine-tuning); artifacts/metrics/curves/<case>-{loss,eval}.json (DVC plots: per step
and per epoch, compiled and PyTorch; empty without fine-tuning); artifacts/cases/<case>/
evaluate/: weights.safetensors (the fine-tuned weights, by the source's names),
optimizer.safetensors (its state as torch.optim's: frontends/weights.py, load_optimizer_state),
a LoRA scheme's export, and for a transformers model what its tools load (pipelines/exports):
pretrained/ (from_pretrained, LoRA merged, the data's tokenizer beside it, its class names
as id2label), a LoRA case's PEFT
adapter/, a LLaMA or Qwen2 causal LM's model.gguf.
"""
import shutil
import sys

from pipelines.data import CLASSES, FILE
from pipelines.data.tokenizer import DIRECTORY
from pipelines.evaluate.case import evaluate_case, save_finetuned
from pipelines.io import atomic_dir, load_arrays, read_json, write_json_atomic, write_manifest
from pipelines.layout import (case_dir, checkpoint_dir, device_dir, metrics_path, model_dir,
                              resolved_case)
from pipelines.phases import Build, TrainingStep
from pipelines.profiles import resolved_profile
from pipelines.resolve import case_inputs
from pipelines.schema import HOST
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs, build = case_inputs(name, "evaluate"), device_dir(name, HOST, "build")
    data = model_dir(inputs.model_name, "data") / FILE
    result = evaluate_case(
        inputs, resolved_profile(HOST).cores, build,
        TrainingStep.load_initial(case_dir(name, "autodiff")),
        load_arrays(data) if data.exists() else None, read_json(metrics_path("prune", name)),
        Build.load(build).plan, checkpoint_dir(name))
    with atomic_dir(case_dir(name, "evaluate")) as tmp:
        if result.finetuned is not None:
            tokenizer = model_dir(inputs.model_name, "data") / DIRECTORY
            classes = model_dir(inputs.model_name, "data") / CLASSES
            save_finetuned(result.finetuned, inputs.model, tmp,
                           tokenizer if tokenizer.is_dir() else None,
                           read_json(classes) if classes.exists() else None)
        write_manifest(tmp, f"evaluate@{name}", {"build": build,
                                                 "inputs": resolved_case(name, "evaluate")}, {})
    write_json_atomic(metrics_path("evaluate", name), result.metrics)
    for curve, values in result.curves.items():  # DVC plots: empty for a case not fine-tuned
        write_json_atomic(metrics_path("curves", f"{name}-{curve}"), values)
    shutil.rmtree(checkpoint_dir(name), ignore_errors=True)  # done: nothing to go on from


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
