"""Backend switching: the step's matrix products as gemm kernels
(pipelines/transform/isolate_gemms.py), each generated, on OpenBLAS or on cuBLAS
(pipelines/backend/blas.py; cuBLAS's calls checked here through an OpenBLAS stand-in).

A small LLaMA-style decoder (conf/model/llama_tiny.yaml at dim 32, 2 layers, 2 heads, hidden 48,
vocab 64, 16 tokens, batch 2) has products in every layout: nn, nt (a weight read transposed in
the forward pass), tn (weight gradients) and batched attention. Its compiled step (full
backpropagation, SGD lr 0.5 momentum 0.9), every product on OpenBLAS, must follow PyTorch's
over three chained steps (loss within 1e-5 relative at every step, state within rtol 1e-4,
atol 1e-6 at the end), as must the all-generated and all-cuBLAS ones; the build's measurement times both
backends of every product.
"""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from chained_steps import chained_steps_match
from conftest import compose_params, plan_case
from pipelines.backend.blas import OPENBLAS_LIB, gemm_kernels, measure, switch_backends
from pipelines.compile import build
from pipelines.ir import shape_of, signature_of, tensor_type, with_signature
from pipelines.profiles import tvm_target
from pipelines.transform import IsolateGemms

# The default experiment's llama_full case (full backpropagation, SGD), at the old test size
# and with a large step.
OVERRIDES = ["models.llama_tiny.kwargs.vocab=64", "models.llama_tiny.kwargs.dim=32",
             "models.llama_tiny.kwargs.layers=2", "models.llama_tiny.kwargs.heads=2",
             "models.llama_tiny.kwargs.hidden=48", "models.llama_tiny.kwargs.seq_len=16",
             "models.llama_tiny.batch_size=2", "optimizers.sgd.lr=0.5",
             "optimizers.sgd.momentum=0.9", "optimizers.sgd.weight_decay=0.0"]
# Loads a build's library in a fresh process, every symbol bound at load (LD_BIND_NOW).
LOAD = "import sys, tvm; tvm.runtime.load_module(sys.argv[1] + '/step.so')"


@pytest.fixture(scope="module")
def step():
    """(model config, optimizer config, the optimized step, its plan, initial values by Relax
    name): the phases of pipelines/compile.py up to the build, which each test does its own
    way."""
    params = compose_params(*OVERRIDES)
    full, _, optimized = plan_case(params, "llama_full")
    return (params.models["llama_tiny"], params.optimizers["sgd"], optimized.module,
            optimized.plan, full.initial)


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 64, (2, 16)), rng.integers(0, 64, 32)) for _ in range(3)]


@pytest.mark.slow
def test_products_become_gemm_kernels_in_every_layout(step):
    _, _, mod, _, _ = step
    layouts = {str(f.attrs["pockengine_gemm"]) for f in gemm_kernels(mod).values()}
    assert layouts == {"nn", "nt", "tn"}
    assert not any(gv.name_hint.startswith(("matmul", "fused_matmul")) for gv in mod.functions)


def cublas_on_openblas(directory) -> str:
    """tests/cublas_on_openblas.c built: the cuBLAS calls of backend/cublas_sgemm.cc on the
    CPU, through OpenBLAS."""
    import scipy_openblas32

    library = directory / "libcublas_on_openblas.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f"-I{scipy_openblas32.get_include_dir()}",
                    str(Path(__file__).with_name("cublas_on_openblas.c")), "-o", str(library),
                    f"-L{scipy_openblas32.get_lib_dir()}", "-lscipy_openblas",
                    f"-Wl,-rpath,{scipy_openblas32.get_lib_dir()}"], check=True)
    return str(library)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openblas", "generated", "cublas"])
def test_switched_step_matches_pytorch(tmp_path_factory, host_profile, step, backend,
                                       monkeypatch):
    """Every product on each backend. cuBLAS is the shim a GPU profile links
    (backend/cublas_sgemm.cc) calling OpenBLAS through cuBLAS's API on the host's memory: its
    operands' layout checked without a GPU."""
    model, optimizer, mod, plan, values = step
    tmp_path = tmp_path_factory.mktemp("step")
    if backend == "cublas":
        monkeypatch.setenv("POCKENGINE_CUBLAS", cublas_on_openblas(tmp_path_factory.mktemp("so")))
    everything = {name: backend for name in gemm_kernels(mod)}
    # The build measures the host's products: here every product takes ``backend``.
    monkeypatch.setattr("pipelines.backend.blas.measure",
                        lambda mod, target: {n: {"backend": b} for n, b in everything.items()})
    built = build(mod, plan, host_profile, tmp_path).built
    assert {n: r["backend"] for n, r in built["backends"]["kernels"].items()} == everything
    assert (tmp_path / OPENBLAS_LIB).exists() == (backend == "openblas")
    switched = switch_backends(mod, everything)
    called = switched.script()
    assert ("pockengine_sgemm_" in called) == (backend == "openblas")
    assert ("pockengine_cublas_sgemm_" in called) == (backend == "cublas")
    assert bool(gemm_kernels(switched)) == (backend == "generated")

    # Chained steps against PyTorch from the same state: the loss within 1e-5 at every step,
    # the state within rtol 1e-4, atol 1e-6 after the last, frozen parameters untouched.
    built_step = SimpleNamespace(directory=tmp_path, initial=values, signature=signature_of(mod))
    chained_steps_match(built_step, model, optimizer, batches())
    # The library loads in a process that has loaded nothing else: it finds OpenBLAS beside
    # itself (in this one, scipy may have loaded a library with the same symbols).
    run = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "LD_BIND_NOW": "1"})
    assert run.returncode == 0, run.stderr


@pytest.mark.slow
def test_an_int8_weight_goes_to_cublas_widened_and_steps_like_pytorch(tmp_path_factory,
                                                                     host_profile, monkeypatch):
    """cuBLAS multiplies float32 operands only: a GPU build (library_products) gives it an
    int8 weight's products on a float32 copy, the weight widened times its rows' scales by a
    kernel of its own (kernels/gemm.py: widen_kernel), where the GPU rules could schedule the
    scaled product only as dlight's Fallback. Built here with the cuBLAS shim on OpenBLAS (as
    above): the paper scheme's step, its frozen weights int8, still does PyTorch's update on
    the weights they stand for."""
    from pipelines.backend.blas import library_products

    params = compose_params(*OVERRIDES)
    full, _, optimized = plan_case(params, "llama_paper", frozen_dtype="int8")
    mod = optimized.module
    rows = library_products(mod, "cublas")
    widened = {n for n, row in rows.items() if "reads" in row}
    assert rows.keys() == gemm_kernels(mod).keys() and widened
    assert {rows[n]["reads"] for n in widened} == {"int8, widened to float32 first"}
    called = switch_backends(mod, {n: "cublas" for n in rows}, split=False).script()
    assert "widen_operand" in called and "pockengine_sgemm_" not in called
    monkeypatch.setenv("POCKENGINE_CUBLAS", cublas_on_openblas(tmp_path_factory.mktemp("so")))
    monkeypatch.setattr("pipelines.backend.blas.measure", lambda mod, target: rows)
    tmp_path = tmp_path_factory.mktemp("int8")
    build(mod, optimized.plan, host_profile, tmp_path)
    built_step = SimpleNamespace(directory=tmp_path, initial=full.initial,
                                 signature=signature_of(mod))
    chained_steps_match(built_step, params.models["llama_tiny"],
                        params.optimizers[params.cases["llama_paper"].optimizer], batches())


@pytest.mark.slow
def test_measurement_times_both_backends(host_profile, step):
    _, _, mod, _, _ = step
    rows = measure(mod, tvm_target(host_profile))
    assert set(rows) == set(gemm_kernels(mod))
    for row in rows.values():
        assert row["generated_ms"] > 0 and row["openblas_ms"] > 0
        assert row["backend"] == ("openblas" if row["openblas_ms"] * 1.1 < row["generated_ms"]
                                  else "generated")


def test_a_side_that_has_clearly_lost_is_not_timed_again():
    from pipelines.backend.blas import REPEATS, _time

    calls = []
    assert _time(lambda x: calls.append(x), [0]) >= 0 and len(calls) == 1 + REPEATS
    calls.clear()  # over the bound on its first timed call: that call is its time
    assert _time(lambda x: calls.append(x), [0], lost_ms=0.0) >= 0 and len(calls) == 2


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
    mod = IsolateGemms()(with_signature(bb.get(), {"data": ["q", "k"]}))
    assert signature_of(mod) == {"data": ["q", "k"]}  # the module's attributes are kept
    mod = relax.transform.DeadCodeElimination()(mod)
    kernels = gemm_kernels(mod)
    calls = [b.value for block in mod["train_step"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "")
             == "relax.call_tir"]
    assert len(calls) == 1 and calls[0].args[0].name_hint in kernels
    assert all(isinstance(f, tirx.PrimFunc) for f in kernels.values())
    assert [str(f.attrs["pockengine_gemm"]) for f in kernels.values()] == ["nt"]
    assert "permute_dims" not in mod["train_step"].script()


def test_a_matrix_broadcast_over_the_batch_is_read_once():
    """torch.export's 3-D ``x @ w.T`` (attention's output projection) and its gradient's
    ``dy @ w``: matmuls of the batch with ``broadcast_to(permute_dims(w))`` and that permuted
    back. Each becomes one 2-D product of the batch's rows with w itself, read transposed and
    not: no kernel writes w once per batch element, and the numbers are the batched ones."""
    x, w = relax.Var("x", tensor_type([2, 3, 5], "float32")), relax.Var(
        "w", tensor_type([4, 5], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("train_step", [x, w]):
        with bb.dataflow():
            shared = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.permute_dims(w, [1, 0])),
                                                   [2, 5, 4]))
            y = bb.emit(relax.op.matmul(x, shared))
            back = bb.emit(relax.op.matmul(y, bb.emit(relax.op.permute_dims(shared, [0, 2, 1]))))
            out = bb.emit_output(relax.Tuple([y, back]))
        bb.emit_func_output(out)
    before = bb.get()
    mod = relax.transform.DeadCodeElimination()(IsolateGemms()(before))
    kernels = gemm_kernels(mod)
    assert sorted(str(f.attrs["pockengine_gemm"]) for f in kernels.values()) == ["nn", "nt"]
    calls = [b.value for block in mod["train_step"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "")
             == "relax.call_tir"]
    assert [[len(shape_of(a)) for a in c.args[1].fields] for c in calls] == [[2, 2], [2, 2]]
    assert all(c.args[1].fields[1].same_as(w) for c in calls)
    assert "broadcast_to" not in mod["train_step"].script()
    rng = np.random.default_rng(0)
    values = [rng.standard_normal([2, 3, 5]).astype("float32"),
              rng.standard_normal([4, 5]).astype("float32")]
    results = []
    for module in (before, mod):
        executable = tvm.compile(relax.transform.LegalizeOps()(module), target="llvm")
        vm = relax.VirtualMachine(executable, tvm.cpu())
        results.append([r.numpy() for r in vm["train_step"](*map(tvm.runtime.tensor, values))])
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_a_product_reading_a_stored_weight_gives_the_float32_product_of_what_it_stands_for(
        dtype, layout):
    """The shim's ``_bf16``/``_i8`` products (a frozen weight stored narrower, widened a tile
    at a time, an int8 one's rows times their scales) and the generated kernel give numpy's
    float32 product of the widened weight, over several depth blocks and a ragged last tile."""
    import ml_dtypes

    from pipelines.backend.blas import _openblas_module, openblas_function
    from pipelines.kernels.gemm import gemm_kernel

    rng, (m, n, k) = np.random.default_rng(0), (5, 37, 2500)  # k: three blocks of 1024 at most
    a = rng.standard_normal((m, k), dtype=np.float32)
    shape_b = [n, k] if layout == "nt" else [k, n]  # the weight, its rows first
    wide = rng.standard_normal(shape_b, dtype=np.float32)
    if dtype == "int8":
        stored = np.clip(np.rint(wide * 40), -127, 127).astype(np.int8)
        scale = rng.uniform(0.001, 0.05, shape_b[0]).astype(np.float32)
        widened, axis = stored.astype(np.float32) * scale[:, None], "n" if layout == "nt" else "k"
    else:
        stored, scale, axis = wide.astype(ml_dtypes.bfloat16), None, None
        widened = stored.astype(np.float32)
    want = a @ (widened.T if layout == "nt" else widened)
    kernel = gemm_kernel([m, k], shape_b, layout, dtype, axis)
    function = openblas_function(kernel)
    assert function == f"pockengine_sgemm_{layout}_{'i8' if dtype == 'int8' else 'bf16'}"
    b = tvm.runtime.empty(shape_b, dtype, tvm.cpu()).copyfrom(stored)
    operands = [tvm.runtime.tensor(a), b, *([] if scale is None else [tvm.runtime.tensor(scale)])]
    for call in (_openblas_module()[function],
                 tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}),
                             target="llvm")["main"]):
        c = tvm.runtime.empty([m, n], "float32", tvm.cpu())
        call(*operands, c)
        np.testing.assert_allclose(c.numpy(), want, rtol=1e-4, atol=1e-3)
