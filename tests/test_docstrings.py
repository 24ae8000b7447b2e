"""The real text task (pipelines/data/docstrings.py): the standard library's docstrings,
labelled by package and split by module."""
import numpy as np
import pytest

from pipelines.data.docstrings import Config, make, split_by_module
from pipelines.schema import ConfigError

PACKAGES = ["email", "http", "json"]


def config(**fields):
    return Config(**{"kind": "docstrings", "packages": PACKAGES, "seq_len": 32,
                     "test_fraction": 0.3, **fields})


def test_a_module_goes_whole_to_one_side(tmp_path):
    files = []
    for m in range(6):
        path = tmp_path / f"m{m}.py"
        funcs = "".join(f'def f{i}():\n    """module {m} function {i} does things here"""\n'
                        for i in range(m + 1))
        path.write_text(f'"""module {m} says what it is for"""\n{funcs}')
        files.append(path)
    parts = split_by_module(files, 5, 0.3, np.random.default_rng(0))
    sides = {m: {side for side, texts in parts.items() for t in texts if f"module {m} " in t}
             for m in range(6)}
    assert all(len(s) == 1 for s in sides.values())  # never split
    total = sum(m + 2 for m in range(6))
    assert 0 < len(parts["test"]) <= 0.3 * total
    again = split_by_module(files, 5, 0.3, np.random.default_rng(0))
    assert again == parts


def test_the_task_is_labelled_by_package_and_capped():
    data = make(config(per_package=40), seed=0)
    arrays = data.arrays
    for split in ("train", "test"):
        ids, labels = arrays[f"finetune_{split}_x"], arrays[f"finetune_{split}_y"]
        assert ids.shape[1] == 32 and len(ids) == len(labels)
        assert set(labels) == {0, 1, 2} and np.bincount(labels).max() <= 40
        assert (arrays[f"finetune_{split}_attention_mask"] == (ids != 0)).all()
    assert {f.parent.name for f in data.files} >= {"email", "http", "json"}
    again = make(config(per_package=40), seed=0).arrays
    assert all(np.array_equal(again[k], v) for k, v in arrays.items())


def test_a_package_not_in_the_library_is_named_with_the_allowed_ones():
    with pytest.raises(ConfigError,
                       match=r"data.packages has \['nonsense'\].*allowed: \[.*'email'"):
        make(config(packages=["email", "nonsense"]), seed=0)
