"""data@<model>: the data the model's cases train and are timed on (its ``data`` section).

Output: artifacts/models/<model>/data/data.npz (pipelines/data: digits, the text task's
sentences, synthetic tokens, or the user's files under data/: text, jsonl, csv_file, images),
the tokenizer the text was read with (tokenizer/, as save_pretrained writes it), a classifier's
class names by label (classes.json: the fine-tuned model's id2label), and the manifest, which
records the user's files read and their hashes; or the manifest alone for a model without data.
"""
import sys

from pipelines.data import CLASSES, FILE, make_data
from pipelines.data.files import relative
from pipelines.data.tokenizer import DIRECTORY
from pipelines.frontends import data_source
from pipelines.io import atomic_dir, save_arrays, write_json_atomic, write_manifest
from pipelines.layout import model_dir, resolved_model
from pipelines.resolve import model_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs = model_inputs(name)
    read = {"inputs": resolved_model(name)}
    with atomic_dir(model_dir(name, "data")) as tmp:
        if inputs.model.data is not None:
            source = data_source(inputs.model)
            made = make_data(inputs.model.data, inputs.seed, source)
            save_arrays(tmp / FILE, made.arrays)
            if made.tokenizer is not None:
                made.tokenizer.save(tmp / DIRECTORY)
            if made.classes is not None:
                write_json_atomic(tmp / CLASSES, made.classes)
            read |= {relative(path): path for path in made.files}
            print(" ".join(f"{k}={len(v)}" for k, v in made.arrays.items() if k.endswith("_y")))
        write_manifest(tmp, f"data@{name}", read, {})


if __name__ == "__main__":
    run_stage(main, sys.argv[1], model=sys.argv[1])
