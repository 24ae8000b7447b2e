"""The regression gate: `dvc metrics diff` against a committed baseline in a scratch git + DVC
repository, tolerances by rule, and `pock regress` exit codes naming what regressed."""
import json
import subprocess

import pytest
import yaml

from pipelines import cli, regress
from pipelines.config import CONF, ConfigError

RULES = [
    {"metrics": "artifacts/benchmark/*.json:speedup_*", "better": "higher", "rel": 0.3},
    {"metrics": "artifacts/benchmark/*.json:compiled.planned_peak_bytes", "better": "lower",
     "rel": 0.01},
    {"metrics": "artifacts/finetune/metrics.json:accuracy_compiled", "better": "higher",
     "abs": 0.03},
]
BASELINE = {"speedup_vs_torch_eager_full": 2.0, "compiled": {"planned_peak_bytes": 1000,
                                                               "median_ms": 10.0}}


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A git + DVC repository whose HEAD commits one benchmark metrics file."""
    git(tmp_path, "init", "-q")
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("metrics:\n  - artifacts/benchmark/host.json\n")
    metrics = tmp_path / "artifacts/benchmark/host.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps(BASELINE))
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "baseline")
    return tmp_path


def measure(repo, **changes):
    current = json.loads(json.dumps(BASELINE))
    current["speedup_vs_torch_eager_full"] = changes.get("speedup", 2.0)
    current["compiled"]["planned_peak_bytes"] = changes.get("peak", 1000)
    current["compiled"]["median_ms"] = changes.get("ms", 10.0)
    (repo / "artifacts/benchmark/host.json").write_text(json.dumps(current))


def verdicts(repo) -> dict:
    return {v["metric"].split(":")[1]: v["verdict"]
            for v in regress.gate(regress.metrics_diff("HEAD", cwd=repo), RULES)}


def test_within_tolerance_passes_and_absolute_times_never_gate(repo):
    measure(repo, speedup=1.5, peak=1005, ms=100.0)  # -25% (allowed 30%), +0.5%, 10x slower
    assert verdicts(repo) == {"speedup_vs_torch_eager_full": "ok",
                              "compiled.planned_peak_bytes": "ok"}


def test_beyond_tolerance_regresses_in_the_worse_direction_only(repo):
    measure(repo, speedup=1.3, peak=900)  # -35% speedup: worse; a smaller peak is better
    assert verdicts(repo) == {"speedup_vs_torch_eager_full": "regressed",
                              "compiled.planned_peak_bytes": "ok"}
    measure(repo, speedup=3.0, peak=1011)
    assert verdicts(repo) == {"speedup_vs_torch_eager_full": "ok",
                              "compiled.planned_peak_bytes": "regressed"}


def test_a_metric_gone_from_the_workspace_fails(repo):
    (repo / "artifacts/benchmark/host.json").write_text(json.dumps({"compiled": {}}))
    assert set(verdicts(repo).values()) == {"missing"}


def test_pock_regress_exits_1_naming_each_regression(repo, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gate_inputs", lambda args: (RULES, "HEAD", repo))
    measure(repo, speedup=1.0)
    assert cli.main(["regress"]) == cli.EXIT_CHECK
    err = capsys.readouterr().err
    assert "REGRESSED: artifacts/benchmark/host.json:speedup_vs_torch_eager_full" in err
    assert "planned_peak_bytes" not in err
    measure(repo)
    assert cli.main(["regress"]) == cli.EXIT_OK


def test_a_baseline_without_the_metrics_is_bad_input(repo, monkeypatch, capsys):
    other = [{"metrics": "artifacts/memory/*:*", "better": "lower", "rel": 0.1}]
    monkeypatch.setattr(cli, "_gate_inputs", lambda args: (other, "HEAD", repo))
    assert cli.main(["regress"]) == cli.EXIT_INPUT
    assert "holds none of the metrics" in capsys.readouterr().err


@pytest.mark.parametrize("rule, message", [
    ({"metrics": "a:b", "better": "up", "rel": 0.1}, "better='up'; allowed"),
    ({"metrics": "a:b", "better": "higher"}, "exactly one of 'rel'"),
    ({"metrics": "a:b", "better": "higher", "rel": 0.1, "abs": 1}, "exactly one of 'rel'"),
    ({"metrics": "a:b", "better": "higher", "rel": -1}, "tolerance -1"),
    ({"metrics": "a:b", "better": "higher", "rel": 0.1, "tol": 1}, "unknown keys ['tol']"),
])
def test_bad_rules_name_the_rule_and_allowed_values(rule, message):
    with pytest.raises(ConfigError, match=r"regress\.rules\[0\].*" + message.replace(
            "[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        regress.check_rules([rule])


def test_committed_rules_are_valid():
    regress.check_rules(yaml.safe_load((CONF / "config.yaml").read_text())["regress"]["rules"])
