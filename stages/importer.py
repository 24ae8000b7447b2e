"""import@<model>: the model from its frontend (``models.<model>.frontend``), with its weights.

Output (artifacts/models/<model>/import/): the imported form (model.pt2: a torch.export
program in training mode; model.onnx; model.mlir, weights.npz and state.json: StableHLO for
JAX and Keras) and layers.json: every parameter with its module path, layer kind and block,
what schemes select.
"""
import sys

from pipelines.frontends import import_model
from pipelines.io import ROOT, atomic_dir, write_manifest
from pipelines.layout import model_dir, resolved_model
from pipelines.resolve import model_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    model, weights = model_inputs(name).model, model_dir(name, "weights")
    with atomic_dir(model_dir(name, "import")) as tmp:
        print(import_model(model, weights, tmp))
        write_manifest(tmp, f"import@{name}", {"source": ROOT / model.source, "weights": weights,
                                               "inputs": resolved_model(name)}, {})


if __name__ == "__main__":
    run_stage(main, sys.argv[1], phase="import", model=sys.argv[1])
