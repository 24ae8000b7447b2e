"""The user's text files (``.txt``, ``.md``, source code) for a causal language model: each
file tokenized with the model's tokenizer (or a BPE trained on the training files), followed by
its end-of-text token, the files of a split joined and cut into rows of ``seq_len`` tokens
(the tail that fills no row is dropped). The held-out files are a seeded share of the files,
never lines of a file the model trains on. Labels are the tokens themselves: the causal loss
scores each position's next token (training/loss.py).

    models.<name>.data: {kind: text, files: data/my_notes, seq_len: 128}
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data.files import held_out, read_text, relative, user_files
from pipelines.schema import ConfigError, Strict

KEY = "models.<name>.data"

TASKS = ("causal_lm",)  # the tasks its labels are for (fine-tuning checks it)


class Config(Strict):
    """models.<name>.data with kind text."""

    kind: Literal["text"]
    files: str  # a folder or glob under data/
    suffixes: list[str] = [".txt", ".md", ".py", ".rst"]  # a folder's files that are read
    seq_len: PositiveInt
    held_out: float = Field(0.1, gt=0, lt=1)  # the share of files scored, not trained on
    max_rows: PositiveInt | None = None  # at most this many training rows (the first)
    vocab_size: PositiveInt | None = None  # a trained tokenizer's (the model has none)


def pack(ids: list[list[int]], seq_len: int) -> np.ndarray:
    """The files' ids joined and cut into (rows, seq_len)."""
    joined = np.fromiter((i for file in ids for i in file), dtype=np.int64)
    rows = len(joined) // seq_len
    return joined[: rows * seq_len].reshape(rows, seq_len)


def make(cfg: Config, seed: int, source):
    from pipelines.data import Dataset
    from pipelines.data.tokenizer import tokenizer_for

    files = user_files(cfg.files, f"{KEY}.files", tuple(cfg.suffixes))
    texts = [read_text(path, f"{KEY}.files") for path in files]
    train, test = held_out(len(files), cfg.held_out, seed, "files", f"{KEY}.files")
    tokenizer = tokenizer_for(source, (texts[i] for i in train), cfg.vocab_size, KEY)
    tail = [tokenizer.end] if tokenizer.end is not None else []
    arrays = {}
    for name, chosen in (("finetune_train", train), ("finetune_test", test)):
        rows = pack([tokenizer.encode(texts[i])[0] + tail for i in chosen], cfg.seq_len)
        if name == "finetune_train" and cfg.max_rows:
            rows = rows[: cfg.max_rows]
        if not len(rows):
            raise ConfigError(f"{KEY}: the {name.removeprefix('finetune_')} files "
                              f"{[relative(files[i]) for i in chosen][:5]} hold fewer than "
                              f"seq_len={cfg.seq_len} tokens; add text or lower seq_len")
        arrays |= {f"{name}_x": rows, f"{name}_y": rows.copy(),
                   f"{name}_attention_mask": np.ones_like(rows)}
    return Dataset(arrays, tokenizer, files)
