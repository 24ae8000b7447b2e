"""Default CPU schedules (pipelines/schedules.py): kernels become parallel and vector-friendly,
and compute what the unscheduled kernels compute."""
import re

import numpy as np
import tvm
from tvm import relax

from pipelines.ir import tensor_type
from pipelines.schedules import schedule_cpu_kernels

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _module() -> tvm.IRModule:
    """A conv2d with a bias-add epilogue, a matrix product and a sum: reduction kernels with
    padding and epilogues to inline, and an elementwise one."""
    x = relax.Var("x", tensor_type([4, 8, 6, 6], "float32"))
    w = relax.Var("w", tensor_type([24, 8, 3, 3], "float32"))
    b = relax.Var("b", tensor_type([1, 24, 1, 1], "float32"))
    m = relax.Var("m", tensor_type([24, 40], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, m]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(x, w, padding=1), b))
            z = bb.emit(relax.op.matmul(relax.op.sum(y, axis=[2, 3]), m))
            out = bb.emit_output(relax.op.multiply(z, z))
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
            for s in ([4, 8, 6, 6], [24, 8, 3, 3], [1, 24, 1, 1], [24, 40])]
    want = _run(mod, args)
    scheduled = mod.clone()
    taken = schedule_cpu_kernels(scheduled)
    assert taken["reduction"] >= 2 and not taken["skipped"], taken
    assert "T.parallel" in scheduled.script() and "T.parallel" not in mod.script()
    np.testing.assert_allclose(_run(scheduled, args), want, rtol=1e-5, atol=1e-5)
    assert schedule_cpu_kernels(scheduled) == {}  # scheduled kernels are left alone


def _exp_kernels(dtype: str):
    """exp and sigmoid (which TVM lowers through exp) of one tensor, built for the CPU."""
    from tvm import te, topi

    x = te.placeholder((4, 1024), dtype, name="x")
    return [tvm.compile(tvm.IRModule({"main": te.create_prim_func([x, op(x)])}), target=TARGET)
            for op in (topi.exp, topi.sigmoid)]


def test_exp_on_the_cpu_is_the_polynomial_and_as_exact_as_libm():
    # Normal inputs, the ends of float32's range and beyond, as softmax's masks give.
    x = np.concatenate([np.linspace(-87.0, 88.0, 4000), [0.0, -88.5, -100.0, -1e30, -np.inf,
                                                          1e-8, -1e-8, 50.0, -50.0]])
    x = np.resize(x, (4, 1024)).astype("float32")
    exact = np.exp(x.astype(np.float64))
    exp, sigmoid = _exp_kernels("float32")
    got = [tvm.runtime.tensor(np.zeros_like(x)) for _ in range(2)]
    exp["main"](tvm.runtime.tensor(x), got[0])
    sigmoid["main"](tvm.runtime.tensor(x), got[1])
    normal = exact > 2 * np.finfo(np.float32).tiny  # not subnormal
    np.testing.assert_allclose(got[0].numpy()[normal], exact[normal], rtol=2e-7)
    assert (got[0].numpy()[~normal] < 1e-37).all()  # underflow: 0, or nearly
    np.testing.assert_allclose(got[1].numpy(), 1 / (1 + np.exp(-x.astype(np.float64))),
                               rtol=3e-7, atol=1e-38)
    # No exp call left in the code; float64 keeps TVM's rule, libm's exp.
    assert not re.search(r"@\S*exp", exp.mod.inspect_source("ll"))
    assert "@exp(" in _exp_kernels("float64")[0].mod.inspect_source("ll")
