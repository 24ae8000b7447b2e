"""The kernel profile (stages/profile): every VM call of a step is timed once, in order; the
loss kernel splits forward from backward, and the kernels returning new state are the updates."""
import json

import numpy as np
import pytest
import yaml

from pipelines.config import CONF, load_profile
from pipelines.ir import save_ir
from pipelines.step import CompiledStep
from stages.build.toolchain import compile_step
from stages.optimize.passes import optimize
from stages.profile.__main__ import kind_of, profile_step, update_kernels
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "mbv2", "arch": "mobilenetv2", "width": 0.35, "num_classes": 10,
         "in_channels": 3, "image_size": 32, "batch_size": 8}
OPT = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@pytest.mark.parametrize("symbol, kind", [
    ("fused_conv2d_transpose_add10", "conv2d transpose (input gradient)"),
    ("conv2d28", "conv2d"), ("fused_conv2d31_multiply80_add23", "conv2d"),
    ("fused_matmul_add", "matmul"), ("gemm_nt2", "matmul"), ("pockengine_sgemm_tn", "matmul"),
    ("batch_norm3", "batch norm"),
    ("fused_variance5_add17_tir_sqrt4_divide9", "batch norm"),
    ("nll_loss_without_weight", "loss"), ("fused_multiply74_sum7", "reduction"),
    ("fused_multiply82_subtract33", "elementwise"), ("vm.builtin.alloc_tensor", "VM builtins")])
def test_kernel_kinds(symbol, kind):
    assert kind_of(symbol) == kind


def test_every_call_is_timed_and_the_updates_are_found(tmp_path):
    from pipelines.models import build_model

    layers, full, signature = full_step(MODEL, OPT)
    scheme = yaml.safe_load((CONF / "sparse" / "mbv2_paper.yaml").read_text())
    step, signature, _ = sparse_step(full, signature, select(scheme, layers))
    signature = dict(signature, scheme="mbv2_paper")
    optimized = optimize(step, signature, reorder=True)
    save_ir(optimized, tmp_path, "train_step")
    compile_step(optimized, load_profile("host", {}), tmp_path)
    (tmp_path / "signature.json").write_text(json.dumps(signature))
    rng = np.random.default_rng(0)

    state = build_model(MODEL).state_dict()
    compiled = CompiledStep(tmp_path, {r: state[t].numpy()
                                       for r, t in signature["torch_names"].items()})
    args = compiled.arguments(rng.standard_normal((8, 3, 32, 32)).astype("float32"),
                              rng.integers(0, 10, 8))
    (first, second), times = profile_step(compiled, args, warmup=1, steps=2)
    assert len(times) == 2
    assert [s for s, _ in first] == [s for s, _ in second]  # the same calls every step
    assert all(seconds > 0 for _, seconds in first)
    symbols = [s for s, _ in first]
    assert sum("nll_loss" in s for s in symbols) >= 1
    updates = update_kernels(tmp_path / "train_step.json")
    # Kernels returning new state: the weight and momentum updates run after the loss, the
    # batch-norm running statistics before it (the profile counts those as forward).
    loss_at = next(i for i, s in enumerate(symbols) if "nll_loss" in s)
    after, before = updates & set(symbols[loss_at + 1:]), updates & set(symbols[:loss_at])
    assert updates == after | before
    assert after
    # The classifier's weight gradient: a product of its own (kept whole for backend switching,
    # generated or on OpenBLAS as measured), its update a kernel after it.
    assert any("gemm" in s for s in symbols[loss_at + 1:])
    assert before and all("multiply" in s and "subtract" in s for s in before)
