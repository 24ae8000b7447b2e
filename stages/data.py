"""data@<model>: the data the model's cases train and are timed on (its ``data`` section).

Output: artifacts/models/<model>/data/data.npz (pipelines/data: digits, the text task's
sentences or synthetic tokens), or nothing but the manifest for a model without data.
"""
import sys

from pipelines.data import FILE, make_data
from pipelines.io import atomic_dir, save_arrays, write_manifest
from pipelines.layout import model_dir, resolved_model
from pipelines.resolve import model_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs = model_inputs(name)
    with atomic_dir(model_dir(name, "data")) as tmp:
        if inputs.model.data is not None:
            arrays = make_data(inputs.model.data, inputs.seed)
            save_arrays(tmp / FILE, arrays)
            print(" ".join(f"{k}={len(v)}" for k, v in arrays.items() if k.endswith("_y")))
        write_manifest(tmp, f"data@{name}", {"inputs": resolved_model(name)}, {})


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
