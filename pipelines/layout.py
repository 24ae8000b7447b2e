"""Where each stage writes, in one place: dvc.yaml's ``outs`` spell the same paths.

    artifacts/code/<stage>.txt             the files a stage's code is made of (stage code)
    artifacts/resolved/                    params.yaml resolved (stage resolve):
        profiles/<device>.json             a device profile
        pretuned/<device>/                 its committed tuning records (device_profiles/tuned)
        models/<model>.json                a model's stages' inputs
        cases/<case>/<stage>.json          a case's stage's inputs
    artifacts/models/<model>/<phase>/      per model: data, weights, import, lower
    artifacts/cases/<case>/<phase>/        per case: autodiff, prune, optimize, evaluate
    artifacts/cases/<case>/<device>/<phase>/   per case and device: tune, build, reference,
                                           package
    artifacts/metrics/<stage>/<name>.json  metrics (committed to git; DVC metrics)
    artifacts/checkpoints/<case>/          a fine-tuning run's last checkpoint, until it ends

What each phase writes inside its directory: pipelines/phases.py.
"""
from __future__ import annotations

from pathlib import Path

from pipelines.io import ARTIFACTS, ROOT
from pipelines.schema import HOST

# A build's signature (pipelines/phases.py writes it): here, so that a process that times a
# peer reads it without importing TVM
SIGNATURE = "signature.json"
# OpenBLAS's library beside a build's step.so (pipelines/backend/blas.py copies it there): here,
# so that a process on TVM's runtime alone (a GPU host's) can read which kernels it runs
OPENBLAS_LIB = "libscipy_openblas.so"


def stage_name(stage: str, case: str, device: str | None = None) -> str:
    """dvc.yaml's name of a stage run for a case (and a device): ``prune@mbv2``,
    ``build@mbv2`` for the host and ``device_build@mbv2-rpi4`` for a device,
    ``benchmark@mbv2-rpi4``."""
    if device is None:
        return f"{stage}@{case}"
    if stage in ("tune", "build"):
        return f"{stage}@{case}" if device == HOST else f"device_{stage}@{case}-{device}"
    return f"{stage}@{case}-{device}"

def model_dir(model: str, phase: str) -> Path:
    return ARTIFACTS / "models" / model / phase


def case_dir(case: str, phase: str) -> Path:
    return ARTIFACTS / "cases" / case / phase


def device_dir(case: str, device: str, phase: str) -> Path:
    return ARTIFACTS / "cases" / case / device / phase


def pretuned(device: str) -> Path:
    """The committed tuning database of ``device`` (backend/databases.py; may not exist)."""
    return ROOT / "device_profiles" / "tuned" / device


def resolved_dir() -> Path:
    return ARTIFACTS / "resolved"


def resolved_profile_path(device: str) -> Path:
    return resolved_dir() / "profiles" / f"{device}.json"


def resolved_pretuned(device: str) -> Path:
    return resolved_dir() / "pretuned" / device


def resolved_model(model: str) -> Path:
    return resolved_dir() / "models" / f"{model}.json"


def resolved_case(case: str, stage: str) -> Path:
    return resolved_dir() / "cases" / case / f"{stage}.json"


def checkpoint_dir(case: str) -> Path:
    """Where evaluate@<case>'s fine-tuning keeps its last checkpoint until it succeeds (not a
    DVC output: a run killed half-way goes on from it)."""
    return ARTIFACTS / "checkpoints" / case


def metrics_path(stage: str, name: str) -> Path:
    return ARTIFACTS / "metrics" / stage / f"{name}.json"


def phase_time_path(phase: str, name: str) -> Path:
    """How long a compile phase's stage ran for ``name`` (pipelines/stage.py: run_stage)."""
    return ARTIFACTS / "metrics" / "time" / phase / f"{name}.json"
