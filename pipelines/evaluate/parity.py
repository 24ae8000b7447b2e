"""A compiled step against PyTorch doing the identical update, step by step from the same state,
on the device the step was built for (the CPU, or the GPU with PyTorch on the same GPU): the
losses, every tensor of the state at the end (runtime/agreement.py's tolerance: elementwise
rtol 1e-4, or an updated tensor's change within 5% of PyTorch's for ReLU6 networks), the
frozen parameters bit-identical, and the set of parameters each side changed the same.

The tests assert the same (tests/conftest.py, assert_steps_match); this is the measurement a
machine without pytest runs (the GPU benchmark, pipelines/gpu.py).
"""
from __future__ import annotations

import numpy as np

from pipelines.runtime.agreement import RTOL, compare

RUNNING_STATISTICS = ("running_mean", "running_var")


def compare_steps(build_dir, model, optimizer, initial: dict, batches: list,
                  device: str = "cpu", chained: bool = True) -> dict:
    """Run the step in ``build_dir`` and PyTorch's step (models/pytorch.py, on ``device``)
    from ``initial`` (by Relax name) on each of ``batches``, one after the other; what agrees
    and by how much. Not ``chained``: each batch one step from ``initial`` (a ReLU6 network's
    chained steps amplify an ulp where an activation meets 0 or 6 chaotically:
    tests/test_train_step.py), each compared."""
    if not chained:
        each = [compare_steps(build_dir, model, optimizer, initial, [batch], device)
                for batch in batches]
        worst = max(each, key=lambda r: r["worst_change_error"])
        return {**worst, "steps": len(batches), "chained": False,
                "losses": [r["losses"][0] for r in each],
                "losses_pytorch": [r["losses_pytorch"][0] for r in each],
                "loss_max_relative_error": max(r["loss_max_relative_error"] for r in each),
                "matches": all(r["matches"] for r in each)}
    import torch

    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import lr_scales_of, make_optimizer, selection_of, train_step
    from pipelines.runtime.step import CompiledStep

    step = CompiledStep(build_dir, initial)
    twin = torch_twin(model, step.signature, initial).to(device)
    before = {k: v.detach().cpu().numpy().copy() for k, v in twin.state_dict().items()}
    selection = selection_of(step.signature)
    update = make_optimizer(twin, optimizer, selection, lr_scales_of(step.signature))
    losses, pytorch_losses = [], []
    for batch in batches:
        tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in batch]
        pytorch_losses.append(train_step(twin, update, *tensors, task=step.signature["task"]))
        losses.append(step.step(*batch))
    after = {k: v.numpy() for k, v in step.state_dict().items()}
    want = {k: v.detach().cpu().numpy() for k, v in twin.state_dict().items() if k in after}
    names = sorted(want)
    agreement = compare([after[n] for n in names], [want[n] for n in names],
                        [before[n] for n in names])
    frozen = [n for n in names if n not in selection and not n.endswith(RUNNING_STATISTICS)]
    changed = {n for n in names if not np.array_equal(after[n], before[n])}
    changed_pytorch = {n for n in names if not np.array_equal(want[n], before[n])}
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, pytorch_losses))
    return {
        "steps": len(batches), "chained": True, "losses": losses, "losses_pytorch": pytorch_losses,
        "loss_max_relative_error": loss_error,
        "losses_match": loss_error <= RTOL,
        "tensors": len(names), "tensors_match": agreement["matches_host"],
        "worst_diff_over_tolerance": agreement["worst_diff_over_tolerance"],
        "worst_change_error": agreement["worst_change_error"],
        "frozen": len(frozen),
        "frozen_bit_identical": all(np.array_equal(after[n], before[n]) for n in frozen),
        "trained": len(selection),
        "trained_set_equal": changed == changed_pytorch,
        "matches": (loss_error <= RTOL and agreement["matches_host"]
                    and all(np.array_equal(after[n], before[n]) for n in frozen)
                    and changed == changed_pytorch),
    }
