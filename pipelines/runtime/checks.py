"""What a training step may take and give, checked before it runs and before its results are
kept: its inputs of the shapes it was built for and finite, its labels ones the loss can score,
its loss and new state finite.
Numpy only: the Python runner (python_runner.py) needs nothing more; the native runner
(native_runner.cc) makes the same checks in C++.

A step's signature says what its labels may be (training/graph.py): ``labels.classes`` (the
logits' last axis) and ``labels.ignore_index`` (a label that scores nothing); and what an
integer input that indexes a table may be: ``data_types.<input>.rows``.
"""
from __future__ import annotations

import numpy as np


class StepError(ValueError):
    """A batch the step cannot take, or a step whose result is not finite: the message names
    the step, the array and what is allowed."""


class BadBatch(StepError):
    """Input the step cannot take (bad input: exit code 2 where a command meets it)."""


def check_shapes(types: dict[str, dict], arrays: dict, where: str, what: str = "input") -> None:
    """``arrays`` have the dtype and shape ``types`` gives them by name ({"dtype", "shape"}).
    The built step does not check them itself (backend/checked_once.py): a wrong one would be
    read out of bounds."""
    for name, array in arrays.items():
        want = types[name]
        dtype, shape = str(array.dtype), list(array.shape)
        if dtype != want["dtype"] or shape != list(want["shape"]):
            raise BadBatch(f"{where}: {what} {name!r} is {dtype} {shape}; allowed: "
                           f"{want['dtype']} {list(want['shape'])}")


def check_batch(signature: dict, arrays: dict[str, np.ndarray], where: str) -> None:
    """``arrays`` (the step's data inputs by name) hold finite floats, indices within the
    tables they index (a data type's ``rows``: analysis/indices.py) and scorable labels."""
    types = signature.get("data_types") or {}
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            count = int(np.size(array) - np.isfinite(array).sum())
            raise BadBatch(f"{where}: input {name!r} holds {count} non-finite values (NaN or "
                            "inf); allowed: finite numbers")
        rows = types.get(name, {}).get("rows")
        if rows is not None and array.size and (array.min() < 0 or array.max() >= rows):
            bad = (array < 0) | (array >= rows)
            shown = sorted({int(v) for v in array[bad].ravel()[:1000]})[:5]
            raise BadBatch(f"{where}: input {name!r} holds {shown}, past the table it indexes; "
                            f"allowed: 0 to {rows - 1} (its {rows} rows: for token ids, the "
                            "model's vocabulary)")
    labels = signature.get("labels") or {}
    if labels.get("classes") and "labels" in arrays:
        y, ignore = np.asarray(arrays["labels"]), labels["ignore_index"]
        bad = (y != ignore) & ((y < 0) | (y >= labels["classes"]))
        if bad.any():
            shown = sorted({int(v) for v in y[bad].ravel()[:1000]})[:5]
            raise BadBatch(f"{where}: labels {shown} are out of range; allowed: 0 to "
                            f"{labels['classes'] - 1} (the model's {labels['classes']} "
                            f"classes), or {ignore} (scores nothing)")


def check_finite(results: dict[str, np.ndarray], where: str, in_place: bool = False) -> None:
    """The step's loss and new state (by name) are finite: a step that is not keeps nothing,
    unless it updates its state ``in_place`` (transform/update_in_place.py): then its values
    are already written over the state, which the error says."""
    kept = ("the step updates its state in place: its values replaced the state, whose last "
            "good copy is the last checkpoint (or the weights the run started from)"
            if in_place else "the state before the step is kept")
    for name, value in results.items():
        if not np.isfinite(value).all():
            what = "its loss" if name == "loss" else f"its new {name}"
            raise StepError(f"{where}: {what} is not finite (NaN or inf); {kept}. A smaller "
                            "learning rate, or data without extreme values, usually avoids it")
