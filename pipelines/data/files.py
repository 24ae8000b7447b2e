"""The user's files, as the data kinds that read them (text, jsonl, csv_file, images) name them:
a folder or a glob under ``data/``, the folder the data stages depend on (dvc.yaml), so that a
changed file reruns what reads it and nothing else; and the held-out split, made the same way
for each of them (seeded, by file or by record, never by line)."""
from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import numpy as np

from pipelines.io import ROOT
from pipelines.schema import ConfigError

DATA = Path("data")  # the user's data, under the checkout


def user_files(pattern: str, key: str, suffixes: tuple[str, ...] = ()) -> list[Path]:
    """The files ``pattern`` names (a folder: every file under it ending in one of
    ``suffixes``, or any; or a glob), sorted; a ConfigError naming ``key`` where it is
    outside data/ or names nothing."""
    parts = Path(pattern).parts
    if Path(pattern).is_absolute() or parts[:1] != DATA.parts or ".." in parts:
        raise ConfigError(f"{key}={pattern!r}: outside data/; allowed: a folder or glob under "
                          "data/ (the folder the data stages depend on: DVC would not see a "
                          "file elsewhere change); copy or link it there")
    root = ROOT / pattern
    if not glob.has_magic(pattern) and not root.exists():
        raise ConfigError(f"{key}={pattern!r}: no such file or folder; allowed: a file, "
                          "folder or glob under data/")
    if root.is_dir():
        found = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                 and (not suffixes or p.suffix.lower() in suffixes)]
    else:
        found = [Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file()]
    if not found:
        raise ConfigError(f"{key}={pattern!r}: "
                          + ("the glob matches no file" if glob.has_magic(pattern)
                             else "no files in the folder")
                          + (f" ending {list(suffixes)}" if suffixes else ""))
    return sorted(found)


def relative(path: Path) -> str:
    """A data file as the manifest and messages name it: a user's from the checkout's root, one
    of Python's standard library (data/docstrings.py) as ``stdlib/<its path there>``. A link
    under data/ is named where it is, not where it points."""
    path = Path(os.path.abspath(path))
    stdlib = Path(os.path.abspath(sysconfig.get_paths()["stdlib"]))
    if path.is_relative_to(stdlib):
        return f"stdlib/{path.relative_to(stdlib)}"
    return str(path.relative_to(os.path.abspath(ROOT)))


def read_text(path: Path, key: str) -> str:
    """A user's file as text; a ConfigError naming it where it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{relative(path)} ({key}): not UTF-8 text ({err.reason} at byte "
                          f"{err.start}); allowed: UTF-8 text files") from err


def fit_head(names: list[str], source, where: str) -> None:
    """A ConfigError where the data has more classes (``names``, those of ``where``) than the
    model's head scores: a label past its last output has no logit."""
    if source.classes is None:
        return
    if len(names) > source.classes:
        raise ConfigError(f"{where} holds {len(names)} classes {names[:10]}; the model's head "
                          f"scores {source.classes} (models.<name>.{source.classes_key}); set it "
                          f"to {len(names)}")
    if len(names) < source.classes:
        print(f"models.<name>.data: {len(names)} classes; the model's head scores "
              f"{source.classes} (its other outputs are never a label)", flush=True)


def held_out(count: int, fraction: float, seed: int, what: str, key: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) indices of ``count`` items (files or records): a seeded
    ``fraction`` of them held out, at least one on each side."""
    if count < 2:
        raise ConfigError(f"{key}: {count} {what}; a held-out split needs at least 2 (one to "
                          "train on, one to score)")
    order = np.random.default_rng([seed, count]).permutation(count)
    test = min(count - 1, max(1, round(fraction * count)))
    return np.sort(order[test:]), np.sort(order[:test])
