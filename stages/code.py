"""code: the files each stage's code is made of, with their hashes (pipelines/code.py).

Output: artifacts/code/<stage>.txt for every module in stages/. Every other stage depends on its
own list, so it reruns exactly when a file it runs changes.
"""
from pipelines.code import listing, stage_modules
from pipelines.io import ARTIFACTS, atomic_dir, write_text_atomic


def main() -> None:
    modules = stage_modules()
    with atomic_dir(ARTIFACTS / "code") as tmp:
        for module in modules:
            write_text_atomic(tmp / f"{module.removeprefix('stages.')}.txt", listing(module))
    print(f"code: the files of {len(modules)} stages")


if __name__ == "__main__":
    main()
