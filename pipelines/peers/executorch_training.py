"""What ExecuTorch training's peers share (the `executorch` package; its training API is
experimental: CPU, fp32, SGD). The twin of the compiled step (the model's own module holding the
step's initial values) with its loss is exported by ``torch.export``, its joint forward and
backward graph made by ``_export_forward_backward`` (gradients of the parameters that require
them: the trained set; the rest are constants), lowered by ``to_edge().to_executorch()`` to a
program, and run by ExecuTorch's runtime (its portable kernels) with its SGD optimizer, as an app
would run a ``.pte`` it ships.

Its SGD is torch.optim.SGD's (momentum, dampening, weight decay, Nesterov), so SGD cases run
their own update. It freezes whole tensors (a channel-sparse parameter is trained whole, as
PyTorch's frozen peer computes it). A batch norm that updates its statistics does not lower (no
out variant of ``_native_batch_norm_legit_functional``): such a case is refused, saying so; one
whose scheme holds them (the paper's) runs them in eval mode.
"""
from __future__ import annotations

import importlib.util

from pipelines.peers.pytorch import losses_beside_pytorch, peer_twin

IMPORTS = ("executorch.extension.training",)
TASKS = ("classification", "causal_lm", "masked_lm", "regression")


def cannot_time(signature: dict, model) -> str | None:
    if importlib.util.find_spec("executorch") is None:
        return "executorch is not installed: pip install -e '.[peers]'"
    if signature["task"] not in TASKS:
        return (f"ExecuTorch training's losses here are {', '.join(TASKS)}; this case's task "
                f"is {signature['task']}")
    optimizer = signature["optimizer"]["torch_class"]
    if optimizer != "SGD":
        return f"ExecuTorch training has an SGD optimizer only, not {optimizer}"
    return None


def refuse_training_norms(model) -> None:
    """Raise, naming them, if ``model`` has batch norms that update their statistics."""
    from pipelines.models.pytorch import batch_norms

    training = batch_norms(model, training=True)
    if training:
        raise ValueError(
            f"ExecuTorch training cannot lower a batch norm that updates its statistics "
            f"({len(training)}: {', '.join(training[:3])} ...); a scheme that holds them "
            f"(statistics: trained_layers, freezing their scales) can be timed")


def _with_loss(model, task: str):
    """``model`` and its loss as one module: ``forward(*inputs, labels)`` is the loss (what
    ExecuTorch's joint graph differentiates)."""
    import torch

    from pipelines.models.pytorch import task_loss

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *batch):
            *inputs, labels = batch
            return task_loss(task, self.model(*inputs), labels)
    return WithLoss()


def _empty_permuted(size, physical_layout, **options):
    """aten.empty_permuted (a backward's buffer; not in ExecuTorch's operator set) as empty
    and permute."""
    import torch

    physical = [size[axis] for axis in physical_layout]
    return torch.empty(physical, **options).permute(
        [physical_layout.index(axis) for axis in range(len(size))])


def training_program(model_section, initial: dict, signature: dict, batch, frozen: bool):
    """The ExecuTorch program (``.pte`` bytes) of the case's twin from ``initial`` whose joint
    graph computes its loss on ``batch`` and the gradients of what it trains (every parameter,
    or with ``frozen`` the scheme's), and the twin with the names it trains."""
    import torch
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    model, names = peer_twin(model_section, initial, signature, frozen)
    refuse_training_norms(model)
    trained = set(names)
    for name, param in model.named_parameters():
        param.requires_grad_(name in trained)
    data = tuple(torch.from_numpy(a) for a in batch)
    exported = torch.export.export(_with_loss(model, signature["task"]), data,
                                   strict=False)
    joint = _export_forward_backward(exported).run_decompositions(
        {torch.ops.aten.empty_permuted.default: _empty_permuted})
    return to_edge(joint).to_executorch().buffer, model, names


def et_step(spec, signature, batch, frozen: bool):
    """One ExecuTorch training step (forward and backward by its runtime, then its SGD) as a
    callable returning the loss: every parameter trained, or with ``frozen`` the scheme's."""
    import torch
    from executorch.extension.training import (_load_for_executorch_for_training_from_buffer,
                                               get_sgd_optimizer)

    # The runtime reads the program where it lies: the bytes must outlive the module.
    buffer = training_program(spec.model, spec.initial, signature, batch, frozen)[0]
    data = tuple(torch.from_numpy(a) for a in batch)
    module = _load_for_executorch_for_training_from_buffer(buffer)
    module.forward_backward("forward", data)  # its parameters are known after a first call
    sgd = spec.optimizer
    optimizer = get_sgd_optimizer(module.named_parameters(), sgd.lr, sgd.momentum, 0.0,
                                  sgd.weight_decay, sgd.nesterov)

    def step() -> float:
        loss = module.forward_backward("forward", data)[0]
        optimizer.step(module.named_gradients())
        return float(loss)
    step.program = buffer
    return step


def first_losses(spec, signature, batch, steps: int, frozen: bool) -> tuple[list, list]:
    """The peer's first losses and PyTorch's doing the same update."""
    return losses_beside_pytorch(et_step(spec, signature, batch, frozen), spec, signature, batch,
                                 steps, frozen, spec.optimizer)
