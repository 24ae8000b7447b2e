"""data@<model>: the data the model's cases train and are timed on (its ``data`` section).

Output: artifacts/models/<model>/data/data.npz (pipelines/data: digits, the text task's
sentences or synthetic tokens), or nothing but the manifest for a model without data.
"""
import sys

from pipelines.config import load_params, run_stage
from pipelines.data import FILE, make_data
from pipelines.io import atomic_dir, save_arrays, write_manifest
from pipelines.layout import model_dir


def main(name: str) -> None:
    params = load_params()
    model = params.models[name]
    with atomic_dir(model_dir(name, "data")) as tmp:
        if model.data is not None:
            arrays = make_data(model.data, params.seed)
            save_arrays(tmp / FILE, arrays)
            print(" ".join(f"{k}={len(v)}" for k, v in arrays.items() if k.endswith("_y")))
        write_manifest(tmp, f"data@{name}", {},
                       {"data": model.data and model.data.model_dump(), "seed": params.seed})


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
