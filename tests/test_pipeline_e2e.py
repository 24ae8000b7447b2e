"""The whole chain with DVC in a temporary copy of the repository, at a small configuration (one
model, one case, deployed to a phone whose build is an archive it links itself): every stage
runs and writes its artifacts, reading no artifact its dvc.yaml entry does not declare (each
stage's reads recorded: pipelines/stage.py), a second `dvc repro` runs nothing, forced reruns of
the IR stages in fresh processes write byte-identical outputs (nothing downstream becomes stale),
changing one parameter reruns only the stages that read it, and a device memory budget takes
the recomputing step or is refused naming the overshoot, leaving the earlier build intact."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.io import ROOT

SMALL = ["experiment=model", "model@models.model=mbv2", "models.model.pretrain.epochs=1",
         "models.model.finetune.epochs=1", "models.model.finetune.runs=1",
         "models.model.data.shift=0",
         # full BP: its kept activations are what recomputation lowers the plan with below
         "cases.model.scheme=full",
         "++cases.model.evaluate=[speed,finetune]", "deploy=[model]", "devices=[android_sd8g2]",
         "package.devices=[]", "benchmark.peers=[torch_eager_full]", "benchmark.warmup=1",
         "benchmark.steps=3", "benchmark.min_seconds=0.2"]


def run(cmd, cwd, env=None):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def stale(status: str) -> set[str]:
    """The stages `dvc status` lists."""
    return set(re.findall(r"^(\S+):$", status, flags=re.M))


def undeclared_reads(repo, log) -> list[tuple[str, str]]:
    """(stage, artifact) for each artifact a stage read that is neither under one of its deps
    nor its own output in the making (a temporary sibling, named ".*")."""
    declared = {entry["cmd"]: [d["path"] for d in entry.get("deps", [])]
                + [o["path"] for o in entry.get("outs", [])]
                for entry in yaml.safe_load((repo / "dvc.lock").read_text())["stages"].values()}
    stage = {entry_cmd: name for name, entry_cmd in
             ((n, e["cmd"]) for n, e in yaml.safe_load(
                 (repo / "dvc.lock").read_text())["stages"].items())}
    bad = []
    for line in log.read_text().splitlines():
        read = json.loads(line)
        path = Path(read["path"]).relative_to(repo)
        if any(part.startswith(".") for part in path.parts):
            continue
        if not any(path == Path(p) or Path(p) in path.parents for p in declared[read["cmd"]]):
            bad.append((stage[read["cmd"]], str(path)))
    return sorted(set(bad))


def workspace(repo):
    """The repository's tracked files, without artifacts or dvc.lock, as a new git repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file() and not name.startswith("artifacts/"):
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    (repo / "dvc.lock").unlink(missing_ok=True)
    run(["git", "init", "-q"], repo)
    return repo


@pytest.mark.slow
def test_repro_builds_everything_then_nothing_then_only_dependants(tmp_path):
    repo = workspace(tmp_path / "repo")
    compose = [sys.executable, "-m", "pipelines.cli", "compose"]
    run(compose + SMALL, repo)

    reads = tmp_path / "reads.jsonl"
    first = run(["dvc", "repro"], repo, env={**os.environ, "POCK_READS": str(reads)})
    assert ran_stages(first) == {
        "code", "resolve", "data@model", "weights@model", "import@model", "lower@model",
        "autodiff@model", "prune@model", "optimize@model", "tune@model", "build@model",
        "evaluate@model", "profile@model", "reference@model", "device_tune@model-android_sd8g2",
        "device_build@model-android_sd8g2", "benchmark@model-android_sd8g2", "report"}
    art = repo / "artifacts"
    for path in ["models/model/lower/model.relax.py", "cases/model/autodiff/train_step.relax.py",
                 "cases/model/prune/train_step.relax.py", "cases/model/optimize/plan.json",
                 "cases/model/host/build/manifest.json",
                 "cases/model/android_sd8g2/build/manifest.json",
                 "metrics/evaluate/model.json", "metrics/benchmark/model-android_sd8g2.json",
                 "report.md"]:
        assert (art / path).is_file(), path
    assert reads.read_text() and undeclared_reads(repo, reads) == []
    # each output is a link to its one copy in DVC's cache (.dvc/config), not a second copy
    assert (art / "models/model/lower/model.relax.py").stat().st_nlink == 2
    evaluated = json.loads((art / "metrics/evaluate/model.json").read_text())
    assert evaluated["finetune"]["accuracy_compiled"] > evaluated["finetune"]["accuracy_before"]

    assert ran_stages(run(["dvc", "repro"], repo)) == set()

    # Byte-identical IR: forced reruns write outputs with the same hashes, so nothing
    # downstream of them becomes stale but the report, which shows how long each phase ran.
    ir_stages = ["lower@model", "autodiff@model", "prune@model", "optimize@model"]
    forced = run(["dvc", "repro", "--force", "--single-item", *ir_stages], repo)
    assert ran_stages(forced) == set(ir_stages)
    # the default pipeline (coverage/dvc.yaml runs on its own)
    assert stale(run(["dvc", "status", "dvc.yaml"], repo)) == {"report"}
    for phase in ["import", "lower", "autodiff", "prune", "optimize", "tune", "build"]:
        timed = art / "metrics/time" / phase / ("model-host.json" if phase in ("tune", "build")
                                                 else "model.json")
        assert json.loads(timed.read_text())["seconds"] > 0, timed
    assert "time to the first step" in (art / "report.md").read_text()
    assert ran_stages(run(["dvc", "repro"], repo)) == {"report"}

    # One parameter: the benchmark's step count is read by evaluate, profile and benchmark
    # (and the seed beside it in the same resolved file, by reference).
    # DVC sees params.yaml change for resolve only; once it has run (pock status runs it), the
    # stages whose resolved inputs changed.
    four_steps = [o if o != "benchmark.steps=3" else "benchmark.steps=4" for o in SMALL]
    run(compose + four_steps, repo)
    assert stale(run(["dvc", "status", "dvc.yaml"], repo)) == {"resolve"}
    run(["dvc", "repro", "resolve"], repo)
    assert stale(run(["dvc", "status", "dvc.yaml"], repo)) == {
        "evaluate@model", "profile@model", "reference@model", "benchmark@model-android_sd8g2"}
    assert ran_stages(run(["dvc", "repro"], repo)) == {
        "evaluate@model", "profile@model", "reference@model", "benchmark@model-android_sd8g2",
        "report"}

    # A budget only the recomputing step fits (just under the plain step's plan): optimize
    # makes the recomputing twin, and the device build takes it and says so.
    plain = json.loads((art / "cases/model/optimize/plan.json").read_text())
    assert plain["recompute"] is None  # no device needed it
    budget = f"+profiles.android_sd8g2.memory_budget_mb={plain['planned_peak_bytes'] / 2**20 - 1e-4}"
    run(compose + four_steps + [budget], repo)
    built = art / "cases/model/android_sd8g2/build"
    assert "recomputing cheap activations" in run(
        ["dvc", "repro", "device_build@model-android_sd8g2"], repo)
    twin = json.loads((art / "cases/model/optimize/plan.json").read_text())["recompute"]
    assert twin["for"] == ["android_sd8g2"]
    assert twin["planned_peak_bytes"] < plain["planned_peak_bytes"]
    assert json.loads((built / "plan.json").read_text()) == twin

    # A budget nothing fits: refused, naming the overshoot and what recomputation reached;
    # the earlier build stays.
    before = {p.name: p.read_bytes() for p in built.iterdir()}
    run(compose + four_steps + ["+profiles.android_sd8g2.memory_budget_mb=0.01"], repo)
    refused = subprocess.run(["dvc", "repro", "device_build@model-android_sd8g2"], cwd=repo,
                             capture_output=True, text=True)
    assert refused.returncode != 0
    assert re.search(r"device_profiles/android_sd8g2.yaml: the training step's planned peak is "
                     r"[\d.]+ MiB, over memory_budget_mb=0.01 by [\d.]+ MiB; recomputing cheap "
                     r"activations brings it to [\d.]+ MiB, still over",
                     refused.stderr + refused.stdout)
    assert {p.name: p.read_bytes() for p in built.iterdir()} == before
