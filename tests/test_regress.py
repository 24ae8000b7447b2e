"""The regression gate (pipelines/regress.py): current metrics against a committed
baseline, tolerances by rule (config RegressRule objects: ``rel`` a fraction of the baseline,
``abs`` in the metric's units; only the worse direction gates; absolute times carry no rule, so
never gate), and `pock regress` exit codes naming what regressed. Bad rules are refused when the
configuration is checked (pipelines/config.py), naming params.yaml, the rule's key and what is
allowed.

The fast tests gate diffs shaped as `dvc metrics diff --json --all` gives them; the slow ones
(a few seconds per DVC call) run DVC in a scratch git + DVC repository: that it gives that
shape, and `pock regress` end to end against a committed baseline.
"""
import json
import shutil
import subprocess

import pytest
import yaml

from pipelines import cli
from pipelines.compose import compose_text
from pipelines.config import Regress, RegressRule, validate
from pipelines.schema import ConfigError
from pipelines import regress

METRICS = "artifacts/metrics/evaluate/mbv2.json"
RULES = [RegressRule(**r) for r in [
    {"metrics": "artifacts/metrics/evaluate/*.json:speed.speedup_vs_*", "better": "higher",
     "rel": 0.3},
    {"metrics": "artifacts/metrics/*:*planned_peak_bytes", "better": "lower", "rel": 0.01},
    {"metrics": "artifacts/metrics/evaluate/*.json:finetune.accuracy_compiled",
     "better": "higher", "abs": 0.03},
]]
BASELINE = {"speed": {"speedup_vs_torch_eager_full": 2.0, "compiled": {"median_ms": 10.0}},
            "plan": {"planned_peak_bytes": 1000}, "finetune": {"accuracy_compiled": 0.6}}


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


def current(speedup=2.0, peak=1000, ms=10.0, accuracy=0.6) -> dict:
    metrics = json.loads(json.dumps(BASELINE))
    metrics["speed"]["speedup_vs_torch_eager_full"] = speedup
    metrics["speed"]["compiled"]["median_ms"] = ms
    metrics["plan"]["planned_peak_bytes"] = peak
    metrics["finetune"]["accuracy_compiled"] = accuracy
    return metrics


def _flat(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def diff_of(new: dict) -> dict:
    """What `dvc metrics diff HEAD --json --all` gives for ``new`` against BASELINE (the test
    test_dvc_metrics_diff_is_what_the_gate_reads checks DVC gives this): every key of either
    revision, dotted, with old and new (null where a revision lacks it)."""
    old, new = _flat(BASELINE), _flat(new)
    return {METRICS: {k: {"old": old.get(k), "new": new.get(k)} for k in {*old, *new}}}


def verdicts(diff: dict, rules=RULES) -> dict:
    return {v["metric"].split(":")[1]: v["verdict"] for v in regress.gate(diff, rules)}


def test_within_tolerance_passes_and_absolute_times_never_gate():
    # -25% (allowed 30%), +0.5% (allowed 1%), -0.02 (allowed 0.03), 10x slower (no rule)
    diff = diff_of(current(speedup=1.5, peak=1005, ms=100.0, accuracy=0.58))
    assert verdicts(diff) == {"speed.speedup_vs_torch_eager_full": "ok",
                              "plan.planned_peak_bytes": "ok",
                              "finetune.accuracy_compiled": "ok"}


def test_beyond_tolerance_regresses_in_the_worse_direction_only():
    # -35% speedup and -0.05 accuracy: worse; a smaller peak is better
    assert verdicts(diff_of(current(speedup=1.3, peak=900, accuracy=0.55))) == {
        "speed.speedup_vs_torch_eager_full": "regressed", "plan.planned_peak_bytes": "ok",
        "finetune.accuracy_compiled": "regressed"}
    assert verdicts(diff_of(current(speedup=3.0, peak=1011, accuracy=0.9))) == {
        "speed.speedup_vs_torch_eager_full": "ok", "plan.planned_peak_bytes": "regressed",
        "finetune.accuracy_compiled": "ok"}


def test_a_metric_gone_from_the_workspace_fails():
    assert set(verdicts(diff_of({"speed": {}})).values()) == {"missing"}


def test_the_first_matching_rule_decides():
    loose = RegressRule(metrics="*speedup*", better="higher", rel=0.9)
    diff = diff_of(current(speedup=1.3))
    assert verdicts(diff, [loose, *RULES])["speed.speedup_vs_torch_eager_full"] == "ok"
    assert verdicts(diff, [*RULES, loose])["speed.speedup_vs_torch_eager_full"] == "regressed"


def test_the_projects_rules_gate_agreement_tightly_and_not_the_starting_score(params):
    # The lane's mbv2 on an AVX-512 machine (the baseline) and on an AVX2 one: the pre-trained
    # backbone is rounded differently, so the scores move, and the two sides agree on both.
    lane = {"finetune": {"accuracy_before": 0.1487, "accuracy_compiled": 0.4349,
                         "accuracy_pytorch": 0.4349, "accuracy_difference": 0.0,
                         "final_loss_relative_difference": 5e-9}}

    def diff(**finetune):
        new = lane["finetune"] | finetune
        return {METRICS: {f"finetune.{k}": {"old": v, "new": new[k]}
                          for k, v in lane["finetune"].items()}}

    rules = params.regress.rules
    other_machine = diff(accuracy_before=0.0149, accuracy_compiled=0.4164,
                         accuracy_pytorch=0.4164, final_loss_relative_difference=2e-8)
    assert set(verdicts(other_machine, rules).values()) == {"ok"}
    assert "finetune.accuracy_before" not in verdicts(other_machine, rules)
    # the compiled step parting from PyTorch: two held-out examples of 200, or 0.1% in loss
    assert verdicts(diff(accuracy_compiled=0.4249, accuracy_difference=0.01 + 1e-9), rules)[
        "finetune.accuracy_difference"] == "regressed"
    assert verdicts(diff(final_loss_relative_difference=1e-3), rules)[
        "finetune.final_loss_relative_difference"] == "regressed"
    assert verdicts(diff(accuracy_compiled=0.30, accuracy_pytorch=0.30), rules)[
        "finetune.accuracy_compiled"] == "regressed"


@pytest.fixture
def gate_with(monkeypatch, params):
    """`pock regress` with ``rules`` as regress.rules (baseline HEAD) and DVC's diff giving
    ``diff`` (the slow tests below run DVC itself)."""
    def use(rules, diff):
        ours = params.model_copy(update={"regress": Regress(baseline="HEAD", rules=rules)})
        monkeypatch.setattr(cli, "_params", lambda: ours)
        monkeypatch.setattr(regress, "metrics_diff", lambda baseline, cwd=None: diff)

    return use


def test_pock_regress_exits_1_naming_each_regression(gate_with, capsys):
    gate_with(RULES, diff_of(current(speedup=1.0)))
    assert cli.main(["regress"]) == cli.EXIT_CHECK
    err = capsys.readouterr().err
    assert f"REGRESSED: {METRICS}:speed.speedup_vs_torch_eager_full" in err
    assert "planned_peak_bytes" not in err and "accuracy_compiled" not in err
    gate_with(RULES, diff_of(current()))
    assert cli.main(["regress"]) == cli.EXIT_OK


def test_a_baseline_without_the_metrics_is_bad_input(gate_with, capsys):
    gate_with([RegressRule(metrics="artifacts/memory/*:*", better="lower", rel=0.1)],
              diff_of(current()))
    assert cli.main(["regress"]) == cli.EXIT_INPUT
    assert "holds none of the metrics" in capsys.readouterr().err


# --- with DVC and git themselves -------------------------------------------------------------

needs_dvc = pytest.mark.skipif(shutil.which("dvc") is None or shutil.which("git") is None,
                               reason="dvc (the project's venv) and git are needed on PATH")


@pytest.fixture
def repo(tmp_path):
    """A git + DVC repository whose HEAD commits one evaluate metrics file (with conf/ and
    pipelines/, as `pock` takes a checkout to be)."""
    git(tmp_path, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(f"metrics:\n  - {METRICS}\n")
    (tmp_path / "conf").mkdir(), (tmp_path / "pipelines").mkdir()
    metrics = tmp_path / METRICS
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps(BASELINE))
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "baseline")
    return tmp_path


@pytest.mark.slow
@needs_dvc
def test_dvc_metrics_diff_is_what_the_gate_reads(repo):
    for metrics in (current(speedup=1.3, peak=1011, ms=100.0), {"speed": {}}):
        (repo / METRICS).write_text(json.dumps(metrics))
        got = regress.metrics_diff("HEAD", cwd=repo)
        assert {f: {k: {"old": v["old"], "new": v["new"]} for k, v in keys.items()}
                for f, keys in got.items()} == diff_of(metrics)
    with pytest.raises(ConfigError, match="dvc metrics diff no-such-rev: .*no-such-rev"):
        regress.metrics_diff("no-such-rev", cwd=repo)


@pytest.mark.slow
@needs_dvc
def test_pock_regress_against_a_committed_baseline(repo, monkeypatch, params, capsys):
    ours = params.model_copy(update={"regress": Regress(baseline="HEAD", rules=RULES)})
    monkeypatch.setattr(cli, "_params", lambda: ours)
    monkeypatch.chdir(repo)
    (repo / METRICS).write_text(json.dumps(current(speedup=1.0, ms=50.0)))
    assert cli.main(["regress"]) == cli.EXIT_CHECK
    err = capsys.readouterr().err
    assert f"REGRESSED: {METRICS}:speed.speedup_vs_torch_eager_full" in err
    assert "planned_peak_bytes" not in err and "median_ms" not in err
    assert cli.main(["regress", "--baseline", "no-such-rev"]) == cli.EXIT_INPUT
    assert "dvc metrics diff no-such-rev" in capsys.readouterr().err
    (repo / METRICS).write_text(json.dumps(current(ms=50.0)))
    assert cli.main(["regress"]) == cli.EXIT_OK


@pytest.fixture(scope="module")
def composed() -> dict:
    """conf/ composed with no overrides, as params.yaml holds it."""
    return yaml.safe_load(compose_text([]))


ONE_TOLERANCE = "regress.rules.0 (from conf/config.yaml): give exactly one of rel"


@pytest.mark.parametrize("rule, message", [
    ({"metrics": "a:b", "better": "up", "rel": 0.1},
     "regress.rules.0.better='up' (from conf/config.yaml): Input should be 'higher' or 'lower'"),
    ({"metrics": "a:b", "better": "higher"}, ONE_TOLERANCE),
    ({"metrics": "a:b", "better": "higher", "rel": 0.1, "abs": 1}, ONE_TOLERANCE),
    ({"metrics": "a:b", "better": "higher", "rel": -1},
     "regress.rules.0.rel=-1 (from conf/config.yaml): Input should be greater than or equal to 0"),
    ({"metrics": "a:b", "better": "higher", "rel": 0.1, "tol": 1},
     ("regress.rules.0 (from conf/config.yaml): unknown keys ['tol']; allowed: ['abs', "
      "'better', 'metrics', 'rel']")),
])
def test_bad_rules_name_the_rule_and_allowed_values(composed, rule, message):
    with pytest.raises(ConfigError) as err:
        validate({**composed, "regress": {"baseline": "HEAD", "rules": [rule]}})
    assert str(err.value).startswith("params.yaml: ")
    assert message in str(err.value)


def test_a_bad_rule_is_refused_by_pock_compose():
    with pytest.raises(ConfigError, match=r"params\.yaml: regress\.rules\.0\.better='up'"):
        compose_text(["regress.rules=[{metrics:'a:b',better:up,rel:0.1}]"])


def test_committed_rules_are_valid(params):
    assert params.regress.rules and all(isinstance(r, RegressRule)
                                        for r in params.regress.rules)
    # each committed rule gates a metric the pipeline writes (artifacts/metrics/<stage>/...)
    assert all(r.metrics.startswith("artifacts/metrics/") for r in params.regress.rules)
