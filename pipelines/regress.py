"""The regression gate: current metrics against a committed baseline, per-metric tolerances.

`dvc metrics diff <baseline> --json --all` gives every metric of the workspace next to the same
metric at the baseline revision (metrics files are committed to git: `cache: false` in
dvc.yaml). Each rule of ``regress.rules`` (conf/config.yaml; checked by pipelines/config.py)
names metrics by a glob over
``<file>:<key>`` (keys are dotted paths, e.g. ``compiled.planned_peak_bytes``), which direction
is better, and how far a metric may move the wrong way: ``rel`` as a fraction of the baseline,
``abs`` in the metric's units. Only ruled metrics gate; absolute times should not get a rule
(machines are noisy): gate on ratios measured in one run, memory and accuracy.
"""
from __future__ import annotations

import fnmatch
import json
import subprocess

from pipelines.schema import ConfigError


def metrics_diff(baseline: str, cwd=None) -> dict:
    """{file: {key: {"old", "new"}}} from DVC; a ConfigError when DVC cannot give it."""
    result = subprocess.run(["dvc", "metrics", "diff", baseline, "--json", "--all"],
                            capture_output=True, text=True, cwd=cwd)
    if result.returncode != 0:
        raise ConfigError(f"dvc metrics diff {baseline}: {result.stderr.strip()}")
    return json.loads(result.stdout or "{}")


def _flat(diff: dict) -> dict[str, dict]:
    return {f"{path}:{key}": values for path, keys in diff.items()
            for key, values in keys.items()}


def gate(diff: dict, rules: list[dict]) -> list[dict]:
    """One verdict per ruled metric: the first rule whose glob matches decides."""
    verdicts = []
    for name, values in sorted(_flat(diff).items()):
        rule = next((r for r in rules if fnmatch.fnmatchcase(name, r.metrics)), None)
        if rule is None:
            continue
        old, new = values.get("old"), values.get("new")
        row = {"metric": name, "baseline": old, "current": new, "better": rule.better}
        if not isinstance(old, (int, float)):
            verdicts.append(row | {"verdict": "new", "allowed": None})
            continue
        if not isinstance(new, (int, float)):
            verdicts.append(row | {"verdict": "missing", "allowed": None})
            continue
        slack = rule.rel * abs(old) if rule.rel is not None else rule.abs
        worse = (old - new) if rule.better == "higher" else (new - old)
        row["allowed"] = (old - slack) if rule.better == "higher" else (old + slack)
        verdicts.append(row | {"verdict": "regressed" if worse > slack else "ok"})
    return verdicts


def render(verdicts: list[dict], baseline: str) -> str:
    def fmt(value):
        return "-" if value is None else f"{value:.4g}"

    lines = [f"metric | baseline ({baseline}) | current | allowed | verdict"]
    for v in verdicts:
        bound = "" if v["allowed"] is None else (">= " if v["better"] == "higher" else "<= ")
        lines.append(f"{v['metric']} | {fmt(v['baseline'])} | {fmt(v['current'])} | "
                     f"{bound}{fmt(v['allowed'])} | {v['verdict']}")
    return "\n".join(lines)
