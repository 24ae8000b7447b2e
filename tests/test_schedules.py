"""Default CPU schedules (pipelines/backend/cpu_schedules.py): kernels become parallel and
vector-friendly, and compute what the unscheduled kernels compute (rtol and atol 1e-5). exp,
sigmoid and erf become polynomials nearly as exact as libm: exp rtol 2e-7, sigmoid rtol 3e-7,
erf atol 4e-7 against float64."""
import math
import re

import numpy as np
import pytest
import tvm
from tvm import relax

from pipelines.ir import tensor_type
from pipelines.backend.cpu_schedules import SERIAL_WORK, VECTOR, schedule_cpu_kernels

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _module() -> tvm.IRModule:
    """A conv2d with a bias-add epilogue, a matrix product, a sum and a softmax: reduction
    kernels with padding and epilogues to inline, row reductions (the softmax's max and sum of
    exponentials over 48 contiguous values), and an elementwise one."""
    x = relax.Var("x", tensor_type([4, 8, 6, 6], "float32"))
    w = relax.Var("w", tensor_type([24, 8, 3, 3], "float32"))
    b = relax.Var("b", tensor_type([1, 24, 1, 1], "float32"))
    m = relax.Var("m", tensor_type([24, 48], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, m]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(x, w, padding=1), b))
            z = bb.emit(relax.op.matmul(relax.op.sum(y, axis=[2, 3]), m))
            out = bb.emit_output(relax.op.nn.softmax(relax.op.multiply(z, z)))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    mod = relax.transform.AnnotateTIROpPattern()(mod)
    return relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))


def _run(mod: tvm.IRModule, args: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_scheduled_kernels_compute_the_same():
    mod = _module()
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype("float32")
            for s in ([4, 8, 6, 6], [24, 8, 3, 3], [1, 24, 1, 1], [24, 48])]
    want = _run(mod, args)
    scheduled = mod.clone()
    taken = schedule_cpu_kernels(scheduled)
    assert taken["reduction"] >= 2 and taken["rows"] == 2 and not taken["skipped"], taken
    assert "T.parallel" in scheduled.script() and "T.parallel" not in mod.script()
    np.testing.assert_allclose(_run(scheduled, args), want, rtol=1e-5, atol=1e-5)
    assert schedule_cpu_kernels(scheduled) == {}  # scheduled kernels are left alone


def test_only_loop_nests_worth_waking_the_thread_pool_run_in_parallel():
    from tvm import te, topi

    def scheduled(shape):
        x = te.placeholder(shape, "float32", name="x")
        mod = tvm.IRModule({"main": te.create_prim_func([x, topi.exp(x)])})
        assert schedule_cpu_kernels(mod) == {"spatial": 1}
        return mod.script()

    small, large = [VECTOR // 2, SERIAL_WORK // VECTOR], [VECTOR, SERIAL_WORK // VECTOR]
    assert "T.parallel" not in scheduled(small) and "T.vectorized" in scheduled(small)
    assert "T.parallel" in scheduled(large)


def test_an_empty_tensors_kernel_is_left_unscheduled():
    """A zero-width slice (a shrunk config's empty rotary part): nothing to run, and fusing
    its loops would divide by the zero extent."""
    from tvm import te, topi

    x = te.placeholder((4, 0, 8), "float32", name="x")
    mod = tvm.IRModule({"main": te.create_prim_func([x, topi.exp(x)])})
    assert schedule_cpu_kernels(mod) == {"skipped": 1}


def _kernels(dtype: str, scheduled: bool = False):
    """exp, sigmoid (which TVM lowers through exp) and erf of one tensor, built for the CPU:
    one value at a time, or ``scheduled`` (vectors of VECTOR values)."""
    from tvm import te, topi

    x = te.placeholder((4, 1024), dtype, name="x")
    kernels = []
    for op in (topi.exp, topi.sigmoid, topi.erf):
        mod = tvm.IRModule({"main": te.create_prim_func([x, op(x)])})
        if scheduled:
            assert schedule_cpu_kernels(mod) == {"spatial": 1}
            assert "T.vectorized" in mod.script()
        kernels.append(tvm.compile(mod, target=TARGET))
    return kernels


@pytest.mark.parametrize("scheduled", [False, True], ids=["scalar", "vector"])
def test_exp_and_erf_on_the_cpu_are_polynomials_nearly_as_exact_as_libm(scheduled):
    # Normal inputs, the ends of float32's range and beyond, as softmax's masks give; NaN.
    x = np.concatenate([np.linspace(-87.0, 88.0, 4000), [0.0, -88.5, -100.0, -1e30, -np.inf,
                                                          np.inf, 1e-8, -1e-8, 50.0, -50.0]])
    x = np.resize(x, (4, 1024)).astype("float32")
    x[0, 0] = np.nan
    wide = x.astype(np.float64)
    exact = [np.exp(wide), 1 / (1 + np.exp(-wide)), np.vectorize(math.erf)(wide)]
    kernels = _kernels("float32", scheduled)
    got = []
    for kernel in kernels:
        out = tvm.runtime.tensor(np.zeros_like(x))
        kernel["main"](tvm.runtime.tensor(x), out)
        got.append(out.numpy())
    exp, sigmoid, erf = got
    assert np.isnan(exp[0, 0]) and np.isnan(sigmoid[0, 0]) and np.isnan(erf[0, 0])
    normal = exact[0] > 2 * np.finfo(np.float32).tiny  # not subnormal
    np.testing.assert_allclose(exp[normal], exact[0][normal], rtol=2e-7)
    assert (exp[~normal & ~np.isnan(x)] < 1e-37).all()  # underflow: 0, or nearly
    np.testing.assert_allclose(sigmoid, exact[1], rtol=3e-7, atol=1e-38)
    np.testing.assert_allclose(erf, exact[2], rtol=0, atol=4e-7)
    # No libm call left in the code; float64 keeps TVM's rules (libm's exp).
    for kernel in kernels:
        assert not re.search(r"@\S*(exp|erf)", kernel.mod.inspect_source("ll"))
    # TVM vectorises exp (and sigmoid) loops, not erf's: those LLVM vectorises, or not.
    for kernel in kernels[:2]:
        assert (f"<{VECTOR} x float>" in kernel.mod.inspect_source("ll")) == scheduled
    assert "@exp(" in _kernels("float64")[0].mod.inspect_source("ll")
