"""weights@<model>: the weights the model's cases start from (pipelines/frontends/weights.py):
its source's, or pre-trained here when the model has a ``pretrain`` section.

Output: artifacts/models/<model>/weights/weights.safetensors (a torch model's state dict by
its own names; a model from a file keeps its weights in the file); artifacts/metrics/weights/
<model>.json (the pre-trained model's test accuracy).
"""
import sys

from pipelines.data import FILE
from pipelines.frontends.weights import FILE as WEIGHTS, initial_weights, save_weights
from pipelines.io import ROOT, atomic_dir, load_arrays, write_json_atomic, write_manifest
from pipelines.layout import metrics_path, model_dir, resolved_model
from pipelines.resolve import model_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs = model_inputs(name)
    model, data = inputs.model, model_dir(name, "data") / FILE
    metrics = {"frontend": model.frontend}
    with atomic_dir(model_dir(name, "weights")) as tmp:
        if model.in_pytorch:
            state, trained = initial_weights(model, load_arrays(data) if data.exists() else None,
                                             inputs.seed)
            save_weights(state, tmp / WEIGHTS)
            metrics.update(trained, tensors=len(state))
        write_manifest(tmp, f"weights@{name}", {"source": ROOT / model.source,
                                                "inputs": resolved_model(name)}, {})
    write_json_atomic(metrics_path("weights", name), metrics)
    print(f"weights@{name}: {metrics}")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], model=sys.argv[1])
