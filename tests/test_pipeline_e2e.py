"""The whole pipeline with DVC in a temporary copy of the repository (a small configuration):
every artifact appears, a second `dvc repro` runs nothing, rebuilding the IR stages in fresh
processes gives byte-identical outputs, and changing one parameter reruns only the stages that
depend on it."""
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from pipelines.config import ConfigError
from pipelines.images import engine
from pipelines.models import build_model
from pipelines.torch_ref import seed_everything

ROOT = Path(__file__).resolve().parent.parent
# Devices: the host, and a phone whose build is an archive it links itself (no toolchain or
# emulation needed here; tests/test_devices.py covers those).
SMALL = ["devices=[host,android_sd8g2]", "pretrain.epochs=1", "finetune.epochs=1", "benchmark.warmup=1", "benchmark.steps=3",
         "compare.schemes=[full,mbv2_channels]", "search.blocks.last=1", "search.steps=4",
         "text_task.train_sentences=24", "text_task.test_sentences=24"]
# With a Docker engine: edge_x86 in a container given less memory than TVM's runtime needs (the
# out-of-memory verdict), and the host's package image.
DOCKER_SMALL = ["+profiles.edge_x86.memory_mb=48", "package.devices=[host]"]


def run(cmd, cwd):
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def ran_stages(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def workspace(repo: Path) -> Path:
    """A copy of the repository's tracked files in ``repo``, without artifacts or dvc.lock, as a
    new git repository: a clean checkout to run the pipeline in."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    shutil.rmtree(repo / "artifacts", ignore_errors=True)
    (repo / "dvc.lock").unlink(missing_ok=True)
    run(["git", "init", "-q"], repo)
    return repo


@pytest.mark.slow
def test_repro_builds_everything_then_nothing_then_only_dependants(tmp_path):
    repo = workspace(tmp_path / "repo")
    compose = [sys.executable, "-m", "pipelines.cli", "compose"]
    try:  # with a Docker engine: a box too small for the step, and the host's package
        engine()
        docker = True
    except ConfigError as err:
        docker = False
        warnings.warn(f"docker devices left out of the pipeline: {err}")
    small = ([SMALL[0].replace("]", ",edge_x86]"), *SMALL[1:], *DOCKER_SMALL] if docker
             else [*SMALL, "package.devices=[]"])
    run(compose + small, repo)

    first = run(["dvc", "repro"], repo)
    assert {"data", "pretrain", "import", "lower", "autodiff", "sparse_prune", "optimize",
            "profiles", "tune@host", "build@host", "benchmark@host", "tune@android_sd8g2",
            "build@android_sd8g2",
            "benchmark@android_sd8g2", "finetune", "scheme_search", "schemes", "tune_workloads",
            "workloads", "text_task", "report"} <= ran_stages(first)
    for path in ["import/model.pt2", "import/model.onnx", "lower/model.relax.py",
                 "autodiff/train_step.relax.py", "prune/train_step.relax.py", "prune/report.json",
                 "optimize/plan.json", "tune/host/records.json", "tune_workloads/records.json",
                 "build/host/step.so", "build/host/manifest.json",
                 "profiles/android_sd8g2.json", "build/android_sd8g2/step.tar",
                 "benchmark/host.json", "finetune/metrics.json", "finetune/loss.json",
                 "search/scheme.yaml", "search/contributions.json", "schemes/metrics.json",
                 "workloads/metrics.json", "text_task/metrics.json",
                 "text_task/exports/minilm_lora/adapter.pt",
                 "report.md", "plots/latency.svg", "plots/memory.json", "plots/finetune.svg"]:
        assert (repo / "artifacts" / path).is_file(), path
    # Fine-tuning starts from the trained backbone and the head the model was initialised with.
    seed_everything(0)
    initial = build_model(yaml.safe_load((repo / "params.yaml").read_text())["model"])
    handed = torch.load(repo / "artifacts/pretrain/weights.pt", weights_only=True)
    assert all(torch.equal(handed[k], v) == k.startswith("classifier.")
               for k, v in initial.state_dict().items() if v.is_floating_point())
    if docker:  # recorded, not a crash: the pipeline went on and the other devices ran
        assert {"benchmark@edge_x86", "package@host"} <= ran_stages(first)
        edge = json.loads((repo / "artifacts/benchmark/edge_x86.json").read_text())
        assert edge["verdict"] == "out_of_memory" and edge["memory_mb"] == 48
        assert "compiled" in json.loads((repo / "artifacts/benchmark/host.json").read_text())
        assert "| edge_x86 |" in (repo / "artifacts/report.md").read_text()
        assert "out of memory (48 MiB)" in (repo / "artifacts/report.md").read_text()
        assert (repo / "artifacts/package/host/image.json").is_file()
        trial = json.loads((repo / "artifacts/package/host.json").read_text())["trial"]
        assert trial["verdict"] == "ok" and trial["steps"] == 4  # within host's limits

    second = run(["dvc", "repro"], repo)
    assert ran_stages(second) == set()

    # Byte-identical IR and tuning database: forced reruns of those stages write outputs with
    # the same hashes, so nothing downstream of them becomes stale.
    ir_stages = ["lower", "autodiff", "sparse_prune", "optimize", "tune@host", "tune_workloads"]
    forced = run(["dvc", "repro", "--force", "--single-item", *ir_stages], repo)
    assert ran_stages(forced) == set(ir_stages)
    assert "up to date" in run(["dvc", "status"], repo)

    run(compose + small[:2] + ["finetune.epochs=2"] + small[3:], repo)
    status = run(["dvc", "status"], repo)
    # The schemes stage fine-tunes every scheme with the same epochs: it depends on them too.
    assert re.findall(r"^(\S+):$", status, flags=re.M) == ["finetune", "schemes"]
    third = run(["dvc", "repro"], repo)
    assert ran_stages(third) == {"finetune", "schemes", "report"}

    # A device whose memory budget only the recomputing step fits: build takes it and says so.
    plan = json.loads((repo / "artifacts/optimize/plan.json").read_text())
    plain, recomputed = plan["planned_peak_bytes"], plan["recompute"]["planned_peak_bytes"]
    assert recomputed < plain
    profile = repo / "device_profiles/host.yaml"
    original = profile.read_text()
    profile.write_text(original + f"memory_budget_mb: {(plain + recomputed) / 2 / 2**20:.4f}\n")
    assert "recomputing cheap activations" in run(["dvc", "repro", "build@host"], repo)
    built = repo / "artifacts/build/host"
    assert json.loads((built / "manifest.json").read_text())["params"]["recomputed"] is True
    assert json.loads((built / "plan.json").read_text())["planned_peak_bytes"] == recomputed

    # A budget nothing fits: build refuses, naming the overshoot and what recomputation
    # reached, and the earlier build stays.
    library = (built / "step.so").read_bytes()
    profile.write_text(original + "memory_budget_mb: 1\n")
    refused = subprocess.run(["dvc", "repro", "build@host"], cwd=repo, capture_output=True,
                             text=True)
    assert refused.returncode != 0
    assert re.search(r"device_profiles/host.yaml: the training step's planned peak is "
                     r"[\d.]+ MiB, over memory_budget_mb=1 by [\d.]+ MiB; recomputing cheap "
                     r"activations brings it to [\d.]+ MiB, still over",
                     refused.stderr + refused.stdout)
    assert (built / "step.so").read_bytes() == library
