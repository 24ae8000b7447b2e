"""The kernel profile (pipelines/evaluate/kernel_profile.py, profile@<case>): every VM call of a step is
timed, in order, by the native runner; the loss kernel splits forward from backward, and the
kernels returning new state are the updates."""
import math

import pytest

from conftest import plan_case
from pipelines.compile import build
from pipelines.evaluate.kernel_profile import kind_of, products, profile_step
from pipelines.runtime.step import synthetic_batch


@pytest.mark.parametrize("symbol, kind", [
    ("fused_conv2d_transpose_add10", "conv2d transpose (input gradient)"),
    ("conv2d28", "conv2d"), ("fused_conv2d31_multiply80_add23", "conv2d"),
    ("fused_matmul_add", "matmul"), ("gemm_nt2", "matmul"), ("pockengine_sgemm_tn", "matmul"),
    ("batch_norm3", "batch norm"),
    ("fused_variance5_add17_tir_sqrt4_divide9", "batch norm"),
    ("nll_loss_without_weight", "loss"), ("softmax_nll_loss", "loss"), ("fused_multiply74_sum7", "reduction"),
    ("fused_multiply82_subtract33", "elementwise"), ("vm.builtin.alloc_tensor", "VM builtins")])
def test_kernel_kinds(symbol, kind):
    assert kind_of(symbol) == kind


@pytest.mark.slow
def test_every_call_is_timed_and_the_updates_are_found(tmp_path, params, host_profile):
    # The default experiment's mbv2 case: MobileNetV2 with the paper's scheme, SGD.
    # (every batch norm in training mode, so that the step updates running statistics)
    full, _, optimized = plan_case(params, "mbv2", statistics="every_layer")
    built = build(optimized.module, optimized.plan, host_profile, tmp_path)
    batches = synthetic_batch(built.signature, 0, 3)
    calls, instrumented, plain = profile_step(tmp_path, full.initial, batches, host_profile, 3)
    assert len(instrumented) == len(plain) == 3
    assert all(seconds > 0 for _, seconds, _ in calls)  # the native runner checked that each
    symbols = [s for s, _, _ in calls]                    # step made the same calls
    assert sum("nll_loss" in s for s in symbols) >= 1
    assert any(s.startswith("vm.builtin.") for s in symbols)
    updates = set(built.built["update_kernels"])
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

    # Each product's FLOPs, read by the runner from its operands, are 2 m n k of the GEMM
    # kernel the build made for it (each called once a step: the classifier's forward, its
    # input and weight gradients), and no other call has any.
    def flops(kernel: dict) -> int:
        (a, _, c), trans = kernel["shapes"], kernel["transposed"]
        depth = a[-2] if trans[0] == "t" else a[-1]
        return 2 * math.prod(c) * depth

    kernels = built.built["backends"]["kernels"]
    assert len(kernels) == 3
    assert sorted(f for _, _, f in calls if f) == sorted(flops(k) for k in kernels.values())
    assert all(kind_of(s) == "matmul" for s, _, f in calls if f)
    found = products(calls)
    assert found["calls_per_step"] == 3 and found["gflop_per_s"] > 0
    assert sum(f["calls_per_step"] for f in found["functions"].values()) == 3


def test_the_seeded_batch_is_no_padding():
    """A step profiled or checked on a device runs on synthetic_batch: its token ids must not
    be padding, or MiniLM's mean over the unpadded tokens divides by zero (every step NaN,
    profile@minilm_paper failed so); its labels must be classes."""
    import numpy as np
    import torch

    from pipelines.models.minilm import MiniLM

    signature = {"data": ["tokens", "labels"],
                 "data_types": {"tokens": {"dtype": "int64", "shape": [2, 8]},
                                "labels": {"dtype": "int64", "shape": [2]}}}
    tokens, labels = synthetic_batch(signature, 0, 3)
    assert tokens.shape == (6, 8) and labels.shape == (6,)
    assert (labels == 0).all()
    model = MiniLM(layers=1, num_classes=2)
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(tokens)),
                                             torch.from_numpy(labels))
    assert np.isfinite(loss.item())
