"""The user's CSV for sequence classification: a text column and a label column (header row),
each text tokenized with the model's tokenizer (or a BPE trained on the training rows) to a row
of ``seq_len`` tokens, cut or padded (padding masked). A label is a class by its position in
``labels`` (default: the column's values, sorted; integers read as integers). The held-out rows
are a seeded share of all of them.

    models.<name>.data: {kind: csv_file, files: data/reviews.csv, text_column: review,
                         label_column: stars, seq_len: 64}
"""
from __future__ import annotations

import csv
import io
from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data.files import fit_head, held_out, read_text, relative, user_files
from pipelines.schema import ConfigError, Strict

KEY = "models.<name>.data"

TASKS = ("classification",)  # the tasks its labels are for (fine-tuning checks it)


class Config(Strict):
    """models.<name>.data with kind csv_file."""

    kind: Literal["csv_file"]
    files: str  # a .csv file, or a folder or glob of them, under data/
    text_column: str
    label_column: str
    labels: list[str] | None = None  # the classes in order (default: the values, sorted)
    seq_len: PositiveInt
    held_out: float = Field(0.2, gt=0, lt=1)  # the share of rows scored, not trained on
    vocab_size: PositiveInt | None = None  # a trained tokenizer's (the model has none)


def rows_of(files, cfg: Config) -> list[tuple[str, str]]:
    """(text, label) of every row of every file; a ConfigError naming the file and line of a
    row with too few or too many fields, an empty text or label, or an unclosed quote."""
    found = []
    for path in files:
        reader = csv.reader(io.StringIO(read_text(path, f"{KEY}.files"), newline=""),
                            strict=True)
        start = 1  # where the record being read begins
        try:
            header = next(reader, [])
            for column, key in ((cfg.text_column, "text"), (cfg.label_column, "label")):
                if column not in header:
                    raise ConfigError(f"{relative(path)}: no column {column!r} ({KEY}."
                                      f"{key}_column); allowed: {header}")
            text, label = header.index(cfg.text_column), header.index(cfg.label_column)
            start = reader.line_num + 1
            for fields in reader:
                where, start = f"{relative(path)}:{start}", reader.line_num + 1
                if not fields:  # a blank line
                    continue
                if len(fields) != len(header):
                    raise ConfigError(f"{where}: {len(fields)} fields where the header has "
                                      f"{len(header)}")
                for index in (text, label):
                    if not fields[index].strip():
                        raise ConfigError(f"{where}: the column {header[index]!r} is empty; "
                                          "fill it or remove the row")
                found.append((fields[text], fields[label].strip()))
        except csv.Error as err:
            raise ConfigError(f"{relative(path)}:{start}: not CSV ({err}, in the record from "
                              "this line); a field with a comma, quote or line break is quoted, "
                              "a quote in it doubled") from err
    return found


def classes(values: list[str], cfg: Config) -> list[str]:
    if cfg.labels is not None:
        unknown = sorted(set(values) - set(cfg.labels))
        if unknown:
            raise ConfigError(f"{KEY}.labels={cfg.labels}: the column {cfg.label_column!r} "
                              f"also holds {unknown[:10]}")
        return cfg.labels
    numeric = all(v.lstrip("-").isdigit() for v in values)
    return sorted(set(values), key=int if numeric else str)


def make(cfg: Config, seed: int, source):
    from pipelines.data import Dataset
    from pipelines.data.tokenizer import tokenizer_for

    files = user_files(cfg.files, f"{KEY}.files", (".csv",))
    rows = rows_of(files, cfg)
    names = classes([label for _, label in rows], cfg)
    fit_head(names, source, f"{KEY}.files={cfg.files!r}: the column {cfg.label_column!r}")
    train, test = held_out(len(rows), cfg.held_out, seed, "rows", f"{KEY}.files")
    tokenizer = tokenizer_for(source, (rows[i][0] for i in train), cfg.vocab_size, KEY)
    arrays = {}
    for name, chosen in (("finetune_train", train), ("finetune_test", test)):
        ids = [tokenizer.encode(rows[i][0])[0][: cfg.seq_len] for i in chosen]
        x = np.array([r + [tokenizer.pad] * (cfg.seq_len - len(r)) for r in ids], np.int64)
        mask = np.array([[1] * len(r) + [0] * (cfg.seq_len - len(r)) for r in ids], np.int64)
        arrays |= {f"{name}_x": x, f"{name}_attention_mask": mask,
                   f"{name}_token_type_ids": np.zeros_like(x),
                   f"{name}_y": np.array([names.index(rows[i][1]) for i in chosen], np.int64)}
    print(f"{KEY}: classes {names}", flush=True)
    return Dataset(arrays, tokenizer, files, names)
