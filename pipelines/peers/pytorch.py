"""What PyTorch's peers share: the twin of the compiled step (the model's own module holding the
step's initial values) and its torch.optim update, on the step's batch, on the CPU or the GPU the
compiled step runs on (``spec.device``)."""
from __future__ import annotations


def torch_step(spec, compiled, batch, frozen: bool, compile: bool = False):
    """One eager (or ``compile``d) PyTorch training step as a callable: full backpropagation
    of the plain model, or with ``frozen`` the scheme's model (LoRA adapters and all) with its
    frozen parameters frozen."""
    import torch

    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import make_optimizer, train_step
    from pipelines.runtime.step import selection_of

    model = torch_twin(spec.model, compiled.signature, spec.initial,
                       adapters=frozen).to(spec.device)
    optimizer = make_optimizer(model, spec.optimizer,
                               selection_of(compiled.signature) if frozen else None)
    tensors = [torch.from_numpy(a).to(spec.device) for a in batch]
    # torch.compile: forward and backward compiled (Inductor, C++ on the CPU), the update
    # eager; compiling happens in the first warm-up step, outside the timed ones.
    net = torch.compile(model) if compile else model
    return lambda: train_step(net, optimizer, *tensors, task=compiled.signature["task"])
