"""The data a model is trained and timed on (a model's ``data`` section, by ``kind``): scikit-learn's
digits (real), the standard library's docstrings (real text) and its source code (a code
language model's), the synthetic text task,
synthetic tokens, and the user's files under data/: text, jsonl, csv_file, images
(docs/data.md).

A data kind is a module here, registered in KINDS (pipelines/registry.py): its ``Config`` (the
section, tagged by ``kind``), ``TASKS`` (the tasks its labels are for) and
``make(cfg, seed, source) -> Dataset`` (or just its arrays; ``source``: what it may need of the
model). Every kind gives arrays named
``<split>_x`` (the model's first input) and ``<split>_y`` (labels), and a text kind the columns
a model with several inputs takes by name, ``<split>_attention_mask`` and
``<split>_token_type_ids``; the splits that fine-tuning reads are ``finetune_train`` and
``finetune_test``, the one a step is timed on is the first of ``finetune_train``, ``train``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.registry import entries, tagged_union
from pipelines.schema import ConfigError


@dataclass
class Source:
    """What a data kind may need of the model it feeds (frontends: data_source): the
    directory of its tokenizer and preprocessing settings, its vocabulary's size, its
    config (image size, normalization), and the classes a classifier's head scores where
    they are known before import (and the model's key that sets them)."""

    directory: Path | None = None
    vocabulary: int | None = None
    config: dict = field(default_factory=dict)
    classes: int | None = None
    classes_key: str = ""  # e.g. config.num_labels


@dataclass
class Dataset:
    """A data kind's result: its arrays; the tokenizer its text was read with (saved beside
    the arrays and the fine-tuned model); the user's files it read (the data stage records
    their hashes); a classifier's class names by label (the fine-tuned model's id2label)."""

    arrays: dict[str, np.ndarray]
    tokenizer: object = None  # a data/tokenizer.py Tokenizer
    files: list[Path] = field(default_factory=list)
    classes: list[str] | None = None


KINDS = entries(__name__, ("digits", "sentences", "docstrings", "python_sources", "tokens",
                           "text", "jsonl", "csv_file", "images"), "kind")
Data = tagged_union(KINDS, "kind")  # a model's data section
FILE = "data.npz"
CLASSES = "classes.json"  # beside it: Dataset.classes, where the kind names its classes


def make_data(cfg, seed: int, source: Source | None = None) -> Dataset:
    """What ``cfg`` (a data section) gives, seeded, for a model (``source``)."""
    source = source or Source()
    made = KINDS[cfg.kind].make(cfg, seed, source)
    made = made if isinstance(made, Dataset) else Dataset(made)
    _ids_fit(made.arrays, source.vocabulary)
    return made


def _ids_fit(arrays: dict[str, np.ndarray], vocabulary: int | None) -> None:
    """A ConfigError where a token id has no row in the model's embedding (a tokenizer with
    more tokens than the model): the step would read past the embedding."""
    for name, array in arrays.items():
        if (vocabulary is None or not name.endswith("_x") or array.dtype.kind not in "iu"
                or not array.size):
            continue
        bad = int(array.max()) if array.max() >= vocabulary else int(array.min())
        if not 0 <= bad < vocabulary:
            raise ConfigError(f"models.<name>.data: {name} holds token id {bad}; the model's "
                              f"embedding has {vocabulary} rows (its vocab_size): the tokenizer "
                              "has more tokens than the model has rows for")


def split(data: dict, name: str, inputs: list[str] | None = None) -> tuple[list, np.ndarray]:
    """The split's arrays of the model's ``inputs`` (by forward's names: the first is the
    data's ``x``, each other one the column of its name; default: ``x`` alone), and its
    labels."""
    columns = [f"{name}_x"] + [f"{name}_{n}" for n in (inputs or [])[1:]]
    missing = [c for c in columns if c not in data]
    if missing:
        have = sorted({k[len(name) + 1:] for k in data if k.startswith(name + "_")}
                      - {"x", "y"})
        raise ConfigError(f"models.<name>.data: the model's inputs {inputs} need the columns "
                          f"{missing}; this data has {have or 'none but x and y'} (a text kind: "
                          "attention_mask, token_type_ids)")
    return [data[c] for c in columns], data[f"{name}_y"]


def timing_batch(data: dict, batch_size: int, inputs: list[str] | None = None) -> tuple:
    """The first ``batch_size`` examples of the training split (the model's inputs, then the
    labels): what a step is timed on."""
    name = next(n for n in ("finetune_train", "train") if f"{n}_x" in data)
    xs, y = split(data, name, inputs)
    return tuple(np.ascontiguousarray(a[:batch_size]) for a in [*xs, y])
