"""evaluate@<case>: the case's host build against PyTorch doing the same update, as its
``evaluate`` list asks (pipelines/evaluate/case.py): speed and memory beside the PyTorch peers
in one run; fine-tuning on the model's data, PyTorch beside it.

Output: artifacts/metrics/evaluate/<case>.json (DVC metrics: what the scheme removes, the plan,
speed, fine-tuning); artifacts/metrics/curves/<case>-{loss,accuracy}.json (DVC plots: per step
and per epoch, compiled and PyTorch; empty without fine-tuning); artifacts/cases/<case>/
evaluate/: weights.safetensors (the fine-tuned weights, by the source's names), optimizer.pt
(its state as torch.optim's), a LoRA scheme's export, and for a transformers model pretrained/
(the fine-tuned model, LoRA merged, as a directory from_pretrained loads).
"""
import sys

import torch

from pipelines.config import HOST, case_optimizer, load_params, run_stage
from pipelines.data import FILE
from pipelines.evaluate.case import evaluate_case
from pipelines.frontends.weights import save_weights
from pipelines.io import atomic_dir, load_arrays, read_json, write_json_atomic, write_manifest
from pipelines.layout import case_dir, device_dir, metrics_path, model_dir
from pipelines.profiles import resolved_profile


def main(name: str) -> None:
    params = load_params()
    case, build = params.cases[name], device_dir(name, HOST, "build")
    model = params.models[case.model]
    data = model_dir(case.model, "data") / FILE
    result = evaluate_case(
        name, case, model, case_optimizer(params, case), params.benchmark,
        resolved_profile(HOST)["cores"], build,
        load_arrays(case_dir(name, "autodiff") / "initial.npz"),
        load_arrays(data) if data.exists() else None, read_json(metrics_path("prune", name)),
        read_json(build / "plan.json"), params.seed, params.schemes[case.scheme].lora)
    with atomic_dir(case_dir(name, "evaluate")) as tmp:
        if (tuned := result.finetuned) is not None:
            save_weights(tuned.weights, tmp / "weights.safetensors")
            torch.save(tuned.optimizer_state, tmp / "optimizer.pt")
            if tuned.export is not None:
                save_weights(tuned.export[1], tmp / tuned.export[0])
            if model.frontend == "transformers" and tuned.plain_weights is not None:
                from pipelines.frontends.transformers import save_pretrained

                save_pretrained(model, tuned.plain_weights, tmp / "pretrained")
        write_manifest(tmp, f"evaluate@{name}", {"build": build}, {"case": case.model_dump()})
    write_json_atomic(metrics_path("evaluate", name), result.metrics)
    curves = {"loss": tuned.losses, "accuracy": tuned.accuracy} if tuned else {}
    for curve in ("loss", "accuracy"):  # DVC plots: empty for a case not fine-tuned
        write_json_atomic(metrics_path("curves", f"{name}-{curve}"), curves.get(curve, []))


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
