"""Python's own source code for a code language model: one group of standard-library packages
to pre-train on, another to fine-tune on (code the pre-trained model never saw), each split by
file into training and held-out files, never by line.

A byte-level BPE of ``vocab_size`` tokens is trained on the pre-training files alone (the
tokenizer comes with the pre-trained model, as a downloaded one would). Each split's files are
tokenized as the ``text`` kind does (each followed by its end-of-text token, joined, cut into
rows of ``seq_len``); labels are the tokens themselves. The files read are the data's: the data
stage records their hashes, so data made from another Python's library differs visibly.

    models.<name>.data: {kind: python_sources, pretrain_packages: [asyncio, logging],
                         finetune_packages: [email, http], seq_len: 128, vocab_size: 2048}
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data import Dataset
from pipelines.data.docstrings import check_packages, modules
from pipelines.data.files import held_out
from pipelines.data.text import pack
from pipelines.schema import ConfigError, Strict

KEY = "models.<name>.data"

TASKS = ("causal_lm",)  # the tasks its labels are for (fine-tuning checks it)


class Config(Strict):
    """models.<name>.data with kind python_sources."""

    kind: Literal["python_sources"]
    pretrain_packages: list[str] = Field(min_length=1)
    finetune_packages: list[str] = Field(min_length=1)
    seq_len: PositiveInt
    vocab_size: PositiveInt  # the trained tokenizer's (at most the model's vocabulary)
    held_out: float = Field(0.1, gt=0, lt=1)  # the share of each part's files scored
    max_rows: PositiveInt | None = None  # at most this many training rows a part


def make(cfg: Config, seed: int, source) -> Dataset:
    """{pretrain,finetune}_{train,test}_{x,y,attention_mask}, and the trained tokenizer."""
    from pipelines.data.tokenizer import tokenizer_for

    overlap = sorted(set(cfg.pretrain_packages) & set(cfg.finetune_packages))
    if overlap:
        raise ConfigError(f"{KEY}: {overlap} in both pretrain_packages and finetune_packages; "
                          "the fine-tuning code must be code the pre-trained model never saw")
    parts, read = {}, []
    for part in ("pretrain", "finetune"):
        packages = getattr(cfg, f"{part}_packages")
        check_packages(packages, f"{KEY}.{part}_packages")
        files = [f for package in packages for f in modules(package)]
        texts = [f.read_text(encoding="utf-8") for f in files]
        train, test = held_out(len(files), cfg.held_out, seed, "files",
                               f"{KEY}.{part}_packages")
        # in a seeded order, so that max_rows keeps a sample of the files
        train = np.random.default_rng([seed, len(files)]).permutation(train)
        parts[part] = {"train": [texts[i] for i in train], "test": [texts[i] for i in test]}
        read += files
    tokenizer = tokenizer_for(source, parts["pretrain"]["train"], cfg.vocab_size, KEY)
    arrays = {}
    for part, splits in parts.items():
        for split, texts in splits.items():
            rows = pack([tokenizer.encode(t)[0] + [tokenizer.end] for t in texts], cfg.seq_len)
            if split == "train" and cfg.max_rows:
                rows = rows[: cfg.max_rows]
            name = f"{part}_{split}"
            arrays |= {f"{name}_x": rows, f"{name}_y": rows.copy(),
                       f"{name}_attention_mask": np.ones_like(rows)}
    return Dataset(arrays, tokenizer, read)
