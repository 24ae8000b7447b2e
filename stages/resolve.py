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
from pipelines.layout import resolved_dir
from pipelines.resolve import resolve
from pipelines.stage import run_stage


def main() -> None:
    files, root = resolve(load_params()), resolved_dir()
    with atomic_dir(root) as tmp:  # all or nothing
        for path, text in files.items():
            write_text_atomic(tmp / path.relative_to(root), text)
    print(f"resolve: {len(files)} files")


if __name__ == "__main__":
    run_stage(main)
