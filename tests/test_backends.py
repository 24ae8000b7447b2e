"""Backend switching: the step's matrix products as gemm kernels (stages/optimize/gemm.py), each
generated or on OpenBLAS (pipelines/backends.py).

A small LLaMA-style decoder (the transformer tests' size) has products in every layout: nn, nt
(a weight read transposed in the forward pass), tn (weight gradients) and batched attention.
Its compiled step, every product on OpenBLAS, must follow PyTorch's over three chained steps
(loss within 1e-5 relative, state within rtol 1e-4, atol 1e-6), as must the all-generated one;
the build's measurement times both backends of every product.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
import yaml

from conftest import chained_steps_match
from pipelines.backends import OPENBLAS_LIB, gemm_kernels, measure, switch_backends
from pipelines.config import CONF
from pipelines.step import save_step
from stages.optimize.passes import optimize
from stages.prune.__main__ import prune_scheme
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "llama_test", "arch": "llama", "vocab": 64, "dim": 32, "layers": 2, "heads": 2,
         "hidden": 48, "seq_len": 16, "batch_size": 2}
OPT = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
TARGET = tvm.target.Target({"kind": "llvm"})
# Loads a build's library in a fresh process, every symbol bound at load (LD_BIND_NOW).
LOAD = "import sys, tvm; tvm.runtime.load_module(sys.argv[1] + '/step.so')"


@pytest.fixture(scope="module")
def step():
    layers, full, signature = full_step(MODEL, OPT)
    scheme = yaml.safe_load((CONF / "sparse" / "full.yaml").read_text())
    pruned, sig, _ = prune_scheme(scheme, layers, full, signature)
    return optimize(pruned, sig, reorder=True), sig, select(scheme, layers)


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 64, (2, 16)), rng.integers(0, 64, 32)) for _ in range(3)]


def test_products_become_gemm_kernels_in_every_layout(step):
    mod, _, _ = step
    layouts = {str(f.attrs["pockengine_gemm"]) for f in gemm_kernels(mod).values()}
    assert layouts == {"nn", "nt", "tn"}
    assert not any(gv.name_hint.startswith(("matmul", "fused_matmul")) for gv in mod.functions)


@pytest.mark.parametrize("backend", ["openblas", "generated"])
def test_switched_step_matches_pytorch(tmp_path, step, backend, monkeypatch):
    mod, sig, selection = step
    everything = {name: backend for name in gemm_kernels(mod)}
    monkeypatch.setattr("pipelines.backends.measure",
                        lambda mod, target: {n: {"backend": b} for n, b in everything.items()})
    save_step(mod, sig, TARGET, tmp_path, measured_backends=True)
    assert (tmp_path / OPENBLAS_LIB).exists() == (backend == "openblas")
    switched = switch_backends(mod, everything)
    called = switched.script()
    assert ("pockengine_sgemm_" in called) == (backend == "openblas")
    assert not gemm_kernels(switched) if backend == "openblas" else gemm_kernels(switched)
    chained_steps_match(tmp_path, MODEL, OPT, selection, sig, batches())
    # The library loads in a process that has loaded nothing else: it finds OpenBLAS beside
    # itself (in this one, scipy may have loaded a library with the same symbols).
    run = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "LD_BIND_NOW": "1"})
    assert run.returncode == 0, run.stderr


def test_measurement_times_both_backends(step):
    mod, _, _ = step
    rows = measure(mod, TARGET)
    assert set(rows) == set(gemm_kernels(mod))
    for row in rows.values():
        assert row["generated_ms"] > 0 and row["openblas_ms"] > 0
        assert row["backend"] == ("openblas" if row["openblas_ms"] * 1.1 < row["generated_ms"]
                                  else "generated")
