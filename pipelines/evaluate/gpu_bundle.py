"""A bundle: steps built here, and all a GPU machine needs besides PyTorch to check and time
them (pipelines/gpu.py). A GPU host, like a device, carries no compiler and no package registry:

    cases.json               per case: the model and optimizer sections, the scheme, the seed,
                             the prune report (FLOPs), and its builds
    cases/<case>/speed/      the step at the model's size (step.so with its kernels as a fatbin,
                             signature.json, plan.json, build.json)
    cases/<case>/parity/     a transformers model's step on its first layers (same widths), for
                             the check against PyTorch; else the speed build checks itself
    cases/<case>/<build>/extra.safetensors
                             initial values the model's own seeded initialisation does not
                             make (LoRA adapters); the weights are made there, never shipped
    runner/                  the native runner (runtime/native_runner.cc) built for the GPU
                             host's CPU, with TVM's runtime libraries (CUDA's too) beside it
    runtime/tvm/             TVM's Python package with its runtime libraries only (no
                             libtvm_compiler.so): ``TVM_USE_RUNTIME_LIB=1``
    wheels/                  apache-tvm-ffi, pydantic and peft for the GPU host's Python
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np

CASES = "cases.json"
EXTRA = "extra.safetensors"
RUNNER, RUNTIME, WHEELS = "runner", "runtime", "wheels"
# What TVM's package holds for compiling, not running: the compiler library, sources, headers.
COMPILER_ONLY = ("3rdparty", "src", "include", "lib64", "libtvm_compiler.so", "__pycache__")
# What the step's runner and the PEFT peer import that a PyTorch image with transformers lacks.
WHEEL_PACKAGES = ("apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types",
                  "typing-inspection", "peft", "accelerate", "psutil")


def parity_model(model, layers: int):
    """A transformers model's first ``layers`` layers (the same widths), or None where it is
    already that small or not a transformers model."""
    if model.frontend != "transformers":
        return None
    from pipelines.frontends.transformers import config_of

    if config_of(model).num_hidden_layers <= layers:
        return None
    return model.model_copy(update={"config": {**model.config, "num_hidden_layers": layers}})


def module_values(model, seed: int) -> dict:
    """Every parameter and buffer of ``model``'s own module, seeded (on the CPU: the same values
    on either machine for one PyTorch version), by the source's names."""
    from pipelines.frontends import load_module
    from pipelines.models.pytorch import seed_everything

    seed_everything(seed)
    module, _ = load_module(model)
    return {**{k: v.detach() for k, v in module.named_buffers()},
            **{k: v.detach() for k, v in module.state_dict().items()}}


def save_extra(directory: Path, model, signature: dict, initial: dict, seed: int) -> None:
    """The initial values (by Relax name) that ``module_values`` does not make."""
    from safetensors.numpy import save_file

    made = module_values(model, seed)
    extra = {r: np.ascontiguousarray(initial[r]) for r, s in signature["source_names"].items()
             if s not in made}
    save_file(extra, str(directory / EXTRA))


def initial_values(directory: Path, model, signature: dict, seed: int) -> dict:
    """The step's initial values by Relax name: the module's seeded ones, and the bundle's
    extra ones."""
    from safetensors.numpy import load_file

    made = module_values(model, seed)
    extra = load_file(str(directory / EXTRA))
    return {r: extra[r] if r in extra else made[s].numpy()
            for r, s in signature["source_names"].items()}


def seeded_batches(signature: dict, seed: int, count: int) -> list[tuple]:
    """``count`` seeded batches of the step's shapes: normal floats; token ids and labels
    below 10 (a classifier's classes) or 100 (a vocabulary); a causal LM's labels are its
    tokens (the loss shifts them)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        arrays = {}
        for name in signature["data"]:
            t = signature["data_types"][name]
            if "float" in t["dtype"]:
                arrays[name] = rng.standard_normal(t["shape"]).astype(t["dtype"])
            elif name == "labels" and signature["task"] == "causal_lm":
                first = arrays[signature["data"][0]]
                arrays[name] = first.reshape(t["shape"]).astype(t["dtype"])
            elif name == "attention_mask":
                arrays[name] = np.ones(t["shape"], t["dtype"])
            else:
                high = 10 if name == "labels" else 100
                arrays[name] = rng.integers(0, high, t["shape"]).astype(t["dtype"])
        batches.append(tuple(arrays[n] for n in signature["data"]))
    return batches


def copy_runtime(bundle: Path) -> None:
    """TVM's installed Python package, its compiler left out."""
    import tvm

    source = Path(tvm.__file__).parent
    shutil.copytree(source, bundle / RUNTIME / "tvm",
                    ignore=shutil.ignore_patterns(*COMPILER_ONLY))


def download_wheels(bundle: Path, python: str) -> None:
    """The wheels of WHEEL_PACKAGES, at this environment's versions, for CPython ``python``
    (e.g. "3.12") on x86-64 Linux, from the package index pip uses here."""
    pins = [f"{name}=={version(name)}" for name in WHEEL_PACKAGES]
    platforms = [arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                 "manylinux2014_x86_64") for arg in ("--platform", tag)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", python, "--implementation",
                    "cp", *platforms, "--dest", str(bundle / WHEELS), *pins], check=True)
