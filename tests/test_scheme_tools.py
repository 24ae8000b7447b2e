"""`pock scheme show` and the scheme search on the reference model (small settings: a few
candidates, a few probe steps). They are checked for what they promise: show counts what the
rules select and what pruning saves; search respects its budget and writes a valid scheme."""
import numpy as np
import pytest
import yaml

from pipelines.cli import main as pock
from pipelines.config import ConfigError
from pipelines.models import build_model
from stages.prune.__main__ import prune_scheme
from stages.prune.scheme import select
from stages.prune.show import full_step
from stages.search.search import Probe, memory_cost, search

MODEL = {"name": "mbv2", "arch": "mobilenetv2", "width": 0.35, "num_classes": 10,
         "in_channels": 3, "image_size": 32, "batch_size": 8}
OPT = {"name": "sgd", "lr": 0.01, "momentum": 0.9}
SEARCH = {"base": [{"name": "classifier", "modules": ["classifier.*"], "update": "both"}],
          "kinds": ["conv_pointwise"], "blocks": {"last": 1}, "ratios": [0.25, 1.0],
          "steps": 4}


@pytest.fixture(scope="module")
def step():
    return full_step(MODEL, OPT)


def test_scheme_show_prints_rules_channels_and_savings(capsys):
    assert pock(["scheme", "show", "sparse=mbv2_channels"]) == 0
    out = capsys.readouterr().out
    assert "rule first_pointwise_quarter: 7 parameters" in out
    assert "84 of 336 output channels" in out
    assert "backward + update FLOPs" in out and "saved activations" in out


def test_scheme_show_rejects_unknown_scheme(capsys):
    assert pock(["scheme", "show", "sparse=mbv2_papr"]) == 2
    assert "mbv2_paper" in capsys.readouterr().err


def test_search_respects_the_budget_and_writes_a_valid_scheme(step):
    layers, full, signature = step
    rng = np.random.default_rng(0)
    data = {"finetune_train_x": rng.standard_normal((40, 3, 32, 32)).astype("float32"),
            "finetune_train_y": rng.integers(0, 10, 40).astype("int64")}
    probe = Probe(MODEL, OPT, build_model(MODEL).state_dict(), data, layers, SEARCH["steps"],
                  seed=0)
    base = memory_cost(prune_scheme({"name": "b", "rules": SEARCH["base"]}, layers, full,
                                    signature)[2])
    quiet = {"log": lambda line: None}
    # A roomy budget: every layer that helps at some ratio is chosen, at one ratio.
    scheme, table = search(SEARCH, 100.0, probe, layers, full, signature, "found", **quiet)
    rows = table["candidates"]
    assert [(r["module"], r["ratio"]) for r in rows] == [
        ("features.17.conv.0.0", 0.25), ("features.17.conv.0.0", 1.0),
        ("features.17.conv.2", 0.25), ("features.17.conv.2", 1.0)]
    assert all(r["cost_bytes"] > 0 for r in rows)
    helping = {r["module"] for r in rows if r["contribution"] > 0}
    chosen = [r for r in rows if r["chosen"]]
    assert {r["module"] for r in chosen} == helping and len(chosen) == len(helping)
    assert select(yaml.safe_load(yaml.safe_dump(scheme)), layers)  # a scheme prune accepts
    assert table["chosen_cost_bytes"] == memory_cost(prune_scheme(scheme, layers, full,
                                                                  signature)[2])
    # A budget just below the cheapest candidate: only the base.
    tight = (base + min(r["cost_bytes"] for r in rows) - 1) / 2**20
    scheme, table = search(SEARCH, tight, probe, layers, full, signature, "found", **quiet)
    assert scheme["rules"] == SEARCH["base"] and table["chosen_cost_bytes"] <= tight * 2**20
    with pytest.raises(ConfigError, match="below what the base rules alone need"):
        search(SEARCH, base / 2 / 2**20, probe, layers, full, signature, "x", **quiet)
