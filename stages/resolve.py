"""resolve: params.yaml resolved once into what each stage reads (pipelines/resolve.py): every
device profile the pipeline builds for (``extends`` followed, params.yaml's ``profiles.<name>``
merged on top, checked), and each model's and case's stage inputs, names followed and overrides
applied.

Output: artifacts/resolved/ (profiles/<device>.json, models/<model>.json,
cases/<case>/<stage>.json). Each stage depends on its own file, so a change to params.yaml, or
a new board, reruns exactly the stages whose inputs it changes.
"""
from pipelines.config import load_params
from pipelines.io import atomic_dir, write_text_atomic
from pipelines.layout import RESOLVED
from pipelines.resolve import resolve
from pipelines.stage import run_stage


def main() -> None:
    files = resolve(load_params())
    with atomic_dir(RESOLVED) as tmp:  # all or nothing
        for path, text in files.items():
            write_text_atomic(tmp / path.relative_to(RESOLVED), text)
    print(f"resolve: {len(files)} files")


if __name__ == "__main__":
    run_stage(main)
