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
from tvm import relax

from conftest import chained_steps_match
from pipelines.backends import OPENBLAS_LIB, gemm_kernels, measure, switch_backends
from pipelines.config import CONF
from pipelines.ir import tensor_type
from pipelines.step import save_step
from stages.optimize.gemm import isolate_gemms
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


def test_a_batched_product_reads_a_permuted_operand_transposed():
    """torch.export's 4-D ``q @ k.transpose(-2, -1)``: permute_dims, broadcast_to, a reshape to
    3-D, matmul. The gemm kernel reads k (its leading axes merged) transposed: no kernel writes
    k^T. (The chained steps above check such a product's numbers.)"""
    q, k = (relax.Var(name, tensor_type([2, 3, 5, 4], "float32")) for name in "qk")
    bb = relax.BlockBuilder()
    with bb.function("train_step", [q, k]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            kt = bb.emit(relax.op.reshape(bb.emit(relax.op.broadcast_to(kt, [2, 3, 4, 5])),
                                          [6, 4, 5]))
            q3 = bb.emit(relax.op.reshape(bb.emit(relax.op.broadcast_to(q, [2, 3, 5, 4])),
                                          [6, 5, 4]))
            out = bb.emit_output(relax.op.matmul(q3, kt))
        bb.emit_func_output(out)
    mod, count = isolate_gemms(bb.get())
    mod = relax.transform.DeadCodeElimination()(mod)
    assert count == 1
    assert [str(f.attrs["pockengine_gemm"]) for f in gemm_kernels(mod).values()] == ["nt"]
    assert "permute_dims" not in mod["train_step"].script()
