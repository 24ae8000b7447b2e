"""`pock scheme show` (pipelines/report/scheme.py) and the scheme search
(pipelines/search.py) on the reference model (MobileNetV2, small search settings: a few
candidates, a few probe steps). They are checked for what they promise: show counts what the
rules select and what pruning saves; search respects its budget and writes a valid scheme.

The CLI's commands run prune@<case> through DVC; here the prune stage's own code
(stages/prune.py) runs in-process on a temporary artifacts/ tree holding the full step the chain
makes in memory, and the CLI reads what it wrote.
"""
import numpy as np
import pytest
import yaml
from conftest import compose_params

from pipelines import cli
from pipelines.cli import main as pock
from pipelines.config import SGD, Scheme, Search
from pipelines.schema import ConfigError

OPT = SGD(kind="sgd", lr=0.01, momentum=0.9)
SEARCH = Search(budget_mb=100.0, base=[{"name": "classifier", "modules": ["classifier.*"],
                                         "update": "both"}],
                kinds=["conv_pointwise"], blocks={"last": 1}, ratios=[0.25, 1.0], steps=4)


@pytest.fixture(scope="module")
def mbv2_full(params, tmp_path_factory):
    """The mbv2 model's full training step (every parameter updated: a phases.TrainingStep)
    and its seeded weights, as the autodiff stage has them."""
    from pipelines.compile import import_and_lower, training_graph
    from pipelines.frontends import load_module
    from pipelines.models.pytorch import seed_everything

    model = params.models["mbv2"]
    full = training_graph(import_and_lower(model), OPT)
    seed_everything(0)
    module, _ = load_module(model)
    return full, module.state_dict()


@pytest.fixture
def artifacts(monkeypatch, tmp_path, params):
    """An artifacts/ tree and conf/ of their own, and params.yaml as composed."""
    import pipelines.layout

    monkeypatch.setattr(pipelines.layout, "ARTIFACTS", tmp_path / "artifacts")
    monkeypatch.setattr("pipelines.config.CONF", tmp_path / "conf")
    monkeypatch.setattr(cli, "_params", lambda: params)
    return tmp_path


def autodiff_outputs(case: str, full) -> None:
    """What autodiff@<case> leaves for prune@<case> (``full``: a phases.TrainingStep)."""
    from pipelines.layout import case_dir

    directory = case_dir(case, "autodiff")
    directory.mkdir(parents=True)
    full.save(directory)


def run_prune(monkeypatch, params):
    """`dvc repro prune@<case>` as the CLI asks for it: the prune stage's main, in-process,
    on what the resolve stage makes of ``params``."""
    import stages.prune
    from pipelines.io import write_text_atomic
    from pipelines.resolve import resolve

    for path, text in resolve(params).items():
        write_text_atomic(path, text)
    ran = []

    def repro(targets):
        for target in targets:
            stage, case = target.split("@")
            assert stage == "prune", target
            stages.prune.main(case)
            ran.append(target)
        return cli.EXIT_OK

    monkeypatch.setattr(cli, "_repro", repro)
    return ran


@pytest.mark.slow
def test_scheme_show_prints_rules_channels_and_savings(artifacts, monkeypatch, capsys, params,
                                                       mbv2_full):
    autodiff_outputs("mbv2_channels", mbv2_full[0])
    ran = run_prune(monkeypatch, params)
    assert pock(["scheme", "show", "mbv2_channels"]) == 0
    assert ran == ["prune@mbv2_channels"]
    out = capsys.readouterr().out
    assert "case mbv2_channels: scheme mbv2_channels" in out
    assert "rule first_pointwise_quarter: 7 parameters" in out
    assert "84 of 336 output channels" in out
    assert "rule classifier: 2 parameters" in out
    assert "backward + update FLOPs" in out and "saved activations" in out
    # What the scheme saves, as the report has it: a fraction of full backpropagation.
    from pipelines.io import read_json
    from pipelines.layout import metrics_path

    report = read_json(metrics_path("prune", "mbv2_channels"))
    assert report["scheme"] == "mbv2_channels"
    assert 0 < report["pruned"]["backward_flops"] < report["full"]["backward_flops"]
    assert f"{1 - report['pruned']['backward_flops'] / report['full']['backward_flops']:.1%}" in out


def test_scheme_commands_reject_unknown_or_unsuitable_cases(artifacts, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_repro", lambda targets: pytest.fail(f"ran {targets}"))
    assert pock(["scheme", "show", "mbv2_papr"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "no case 'mbv2_papr'" in err and "'mbv2_channels'" in err
    # A case of rules has nothing to search.
    assert pock(["scheme", "search", "mbv2", "--name", "found"]) == cli.EXIT_INPUT
    assert "has a scheme of rules, not a search" in capsys.readouterr().err
    assert not (artifacts / "conf").exists()


@pytest.mark.slow
def test_search_respects_the_budget_and_writes_a_valid_scheme(artifacts, monkeypatch, capsys,
                                                              mbv2_full):
    from pipelines.search import Probe, cost_of, search

    full, layers, weights = mbv2_full[0].module, mbv2_full[0].layers, mbv2_full[1]
    model = compose_params().models["mbv2"]
    rng = np.random.default_rng(0)
    data = {"finetune_train_x": rng.standard_normal((40, 3, 32, 32)).astype("float32"),
            "finetune_train_y": rng.integers(0, 10, 40).astype("int64")}
    probe = Probe(model, OPT, weights, data, layers, SEARCH.steps, seed=0)
    base_rules = [r.model_dump(exclude_none=True) for r in SEARCH.base]
    base = cost_of(base_rules, layers, full)
    quiet = {"log": lambda line: None}
    # A roomy budget: every layer that helps at some ratio is chosen, at one ratio.
    rules, table = search(SEARCH, probe, layers, full, **quiet)
    rows = table["candidates"]
    assert [(r["module"], r["ratio"]) for r in rows] == [
        ("features.17.conv.0.0", 0.25), ("features.17.conv.0.0", 1.0),
        ("features.17.conv.2", 0.25), ("features.17.conv.2", 1.0)]
    assert all(r["cost_bytes"] > 0 for r in rows)
    helping = {r["module"] for r in rows if r["contribution"] > 0}
    chosen = [r for r in rows if r["chosen"]]
    assert {r["module"] for r in chosen} == helping and len(chosen) == len(helping)
    # A scheme the configuration accepts, through YAML, that the pruning selects from.
    scheme = Scheme.model_validate(yaml.safe_load(yaml.safe_dump({"rules": rules})))
    from pipelines.training.scheme import select

    assert select(scheme.rules, layers)
    assert table["base_cost_bytes"] == base
    assert table["chosen_cost_bytes"] == cost_of(rules, layers, full) <= SEARCH.budget_mb * 2**20
    # A budget just below the cheapest candidate: only the base.
    tight = (base + min(r["cost_bytes"] for r in rows) - 1) / 2**20
    rules, table = search(SEARCH.model_copy(update={"budget_mb": tight}), probe, layers, full,
                          **quiet)
    assert rules == base_rules and table["chosen_cost_bytes"] <= tight * 2**20
    with pytest.raises(ConfigError, match="below what the base rules alone need"):
        search(SEARCH.model_copy(update={"budget_mb": base / 2 / 2**20}), probe, layers, full,
               **quiet)


@pytest.mark.slow
def test_pock_scheme_search_keeps_what_the_search_found(artifacts, monkeypatch, capsys,
                                                        mbv2_full):
    """`pock scheme search <case> --name found`: prune@<case> searches (on the model's weights
    and data files), and the rules it chose become conf/sparse/found.yaml, a scheme the
    configuration accepts."""
    from pipelines.data import FILE as DATA
    from pipelines.frontends.weights import FILE as WEIGHTS
    from pipelines.frontends.weights import save_weights
    from pipelines.io import save_arrays
    from pipelines.layout import case_dir, model_dir

    weights = mbv2_full[1]
    params = compose_params("schemes.searched.search.blocks.last=1",
                            "schemes.searched.search.ratios=[0.25,1.0]",
                            "schemes.searched.search.steps=4",
                            # the fixture's step trains every batch norm: its biases cost more
                            "schemes.searched.search.budget_mb=8")
    monkeypatch.setattr(cli, "_params", lambda: params)
    model_dir("mbv2", "weights").mkdir(parents=True)
    save_weights(weights, model_dir("mbv2", "weights") / WEIGHTS)
    rng = np.random.default_rng(0)
    model_dir("mbv2", "data").mkdir(parents=True)
    save_arrays(model_dir("mbv2", "data") / DATA, {
        "finetune_train_x": rng.standard_normal((40, 3, 32, 32)).astype("float32"),
        "finetune_train_y": rng.integers(0, 10, 40).astype("int64")})
    autodiff_outputs("mbv2_searched", mbv2_full[0])
    ran = run_prune(monkeypatch, params)
    (artifacts / "conf" / "sparse").mkdir(parents=True)
    assert pock(["scheme", "search", "mbv2_searched", "--name", "found"]) == 0
    assert ran == ["prune@mbv2_searched"]
    assert "wrote" in capsys.readouterr().out
    found = yaml.safe_load((artifacts / "conf" / "sparse" / "found.yaml").read_text())
    assert found == yaml.safe_load((case_dir("mbv2_searched", "prune") / "scheme.yaml").read_text())
    scheme = Scheme.model_validate(found)
    base = params.schemes["searched"].search.base
    assert scheme.rules[:len(base)] == base  # the classifier and every bias, then the choices
    assert all(rule.modules[0].startswith("features.17.") for rule in scheme.rules[len(base):])
