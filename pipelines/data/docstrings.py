"""A real text classification task from text that ships with Python: which standard-library
package a docstring comes from (``asyncio``, ``email``, ``http`` ...), tokenized with
all-MiniLM-L6-v2's own tokenizer.

Every module, class and function docstring of at least ``min_words`` words in a package's
modules (its tests left out) is an example, labelled with the package's place in ``packages``.
The split is by module, never by docstring: each package's modules are shuffled (seeded) and
about ``test_fraction`` of its docstrings, in whole modules, go to the test split, so the test
set is code the model never saw. Each split keeps at most ``per_package`` examples of a package
(seeded), so that no package dominates. The modules read are the data's files: the data stage
records their hashes, so data made from another Python version's library differs visibly.
"""
from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data import Dataset
from pipelines.data.sentences import PAD_ID, tokenizer
from pipelines.schema import ConfigError, Strict

TASKS = ("classification",)  # the tasks its labels are for (fine-tuning checks it)
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class Config(Strict):
    """models.<name>.data with kind docstrings."""

    kind: Literal["docstrings"]
    packages: list[str] = Field(min_length=2)  # the classes, in label order
    seq_len: PositiveInt
    test_fraction: Annotated[float, Field(gt=0, lt=1)]
    min_words: PositiveInt = 5
    per_package: PositiveInt = 200  # examples per package and split, at most


def library() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def modules(package: str) -> list[Path]:
    """The package's modules, its tests left out, in a fixed order."""
    root = library() / package
    return [f for f in sorted(root.rglob("*.py"))
            if not any(part.startswith("test") for part in f.relative_to(root).parts)]


def docstrings(path: Path, min_words: int) -> list[str]:
    """The module's docstrings of at least ``min_words`` words, whitespace collapsed."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    texts = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, DOCUMENTED))
    return [" ".join(t.split()) for t in texts if t and len(t.split()) >= min_words]


def split_by_module(files: list[Path], min_words: int, test_fraction: float,
                    rng: np.random.Generator) -> dict[str, list[str]]:
    """A package's docstrings, train and test, whole modules to each side: in seeded order, a
    module goes to test where it fits in ``test_fraction`` of the docstrings, else to train
    (the smallest one to test where none fits)."""
    texts = {f: docstrings(f, min_words) for f in files}
    documented = [texts[f] for f in files if texts[f]]
    target = test_fraction * sum(len(t) for t in documented)
    parts = {"train": [], "test": []}
    order = list(rng.permutation(len(documented)))
    if all(len(documented[i]) > target for i in order) and len(order) > 1:
        smallest = min(order, key=lambda i: len(documented[i]))
        order.remove(smallest)
        parts["test"] += documented[smallest]
    for i in order:
        fits = len(parts["test"]) + len(documented[i]) <= target
        parts["test" if fits else "train"] += documented[i]
    return parts


def check_packages(packages: list[str], key: str) -> None:
    """A ConfigError naming ``key`` and the library's packages where one of ``packages`` is
    not among them."""
    found = sorted(p.name for p in library().iterdir() if (p / "__init__.py").exists())
    unknown = [p for p in packages if p not in found]
    if unknown:
        raise ConfigError(f"params.yaml: {key} has {unknown}, not packages of {library()}; "
                          f"allowed: {found}")


def make(cfg: Config, seed: int, source=None) -> Dataset:
    """The task's splits, tokenized as the sentences kind's ([CLS] text [SEP], padded, longer
    docstrings cut to ``seq_len``), with each [PAD] masked."""
    check_packages(cfg.packages, "data.packages")
    rng = np.random.default_rng(seed)
    texts = {"train": [], "test": []}
    labels = {"train": [], "test": []}
    files = []
    for label, package in enumerate(cfg.packages):
        package_files = modules(package)
        files += package_files
        parts = split_by_module(package_files, cfg.min_words, cfg.test_fraction, rng)
        for split, part in parts.items():
            if not part:
                raise ConfigError(f"params.yaml: data.packages: {package!r} has no {split} "
                                  f"docstrings of at least {cfg.min_words} words in its "
                                  "modules; choose a package with more modules")
            keep = sorted(rng.permutation(len(part))[:cfg.per_package])
            texts[split] += [part[i] for i in keep]
            labels[split] += [label] * len(keep)
    tok = tokenizer(cfg.seq_len)
    tok.enable_truncation(cfg.seq_len)
    arrays = {}
    for split in ("train", "test"):
        order = rng.permutation(len(texts[split]))
        ids = np.array([e.ids for e in tok.encode_batch([texts[split][i] for i in order])],
                       dtype=np.int64)
        arrays[f"finetune_{split}_x"] = ids
        arrays[f"finetune_{split}_y"] = np.array(labels[split], dtype=np.int64)[order]
        arrays[f"finetune_{split}_attention_mask"] = (ids != PAD_ID).astype(ids.dtype)
        arrays[f"finetune_{split}_token_type_ids"] = np.zeros_like(ids)
    return Dataset(arrays, files=files)
