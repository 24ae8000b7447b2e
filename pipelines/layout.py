"""Where each stage writes, in one place: dvc.yaml's ``outs`` spell the same paths.

    artifacts/code/<stage>.txt             the files a stage's code is made of (stage code)
    artifacts/profiles/<device>.json       a device profile, resolved
    artifacts/models/<model>/<phase>/      per model: data, weights, import, lower
    artifacts/cases/<case>/<phase>/        per case: autodiff, prune, optimize
    artifacts/cases/<case>/<device>/<phase>/   per case and device: tune, build, package
    artifacts/metrics/<stage>/<name>.json  metrics (committed to git; DVC metrics)
"""
from __future__ import annotations

from pathlib import Path

from pipelines.io import ARTIFACTS

HOST = "host"  # every case is built for it: parity with PyTorch, fine-tuning, timing


def model_dir(model: str, phase: str) -> Path:
    return ARTIFACTS / "models" / model / phase


def case_dir(case: str, phase: str) -> Path:
    return ARTIFACTS / "cases" / case / phase


def device_dir(case: str, device: str, phase: str) -> Path:
    return ARTIFACTS / "cases" / case / device / phase


def profile_path(device: str) -> Path:
    return ARTIFACTS / "profiles" / f"{device}.json"


def metrics_path(stage: str, name: str) -> Path:
    return ARTIFACTS / "metrics" / stage / f"{name}.json"


def code_list(stage: str) -> Path:
    return ARTIFACTS / "code" / f"{stage}.txt"
