"""What PyTorch's peers share: the twin of the compiled step (the model's own module holding the
step's initial values) and its torch.optim update, on the step's batch, on the CPU or the GPU the
compiled step runs on (``spec.device``). The other peers start from the same twin and are
checked against its update (``peer_twin``, ``losses_beside_pytorch``)."""
from __future__ import annotations


def torch_step(spec, signature, batch, frozen: bool, compile: bool = False):
    """One eager (or ``compile``d) PyTorch training step as a callable: full backpropagation
    of the plain model, or with ``frozen`` the scheme's model (LoRA adapters and all) with its
    frozen parameters frozen."""
    import torch

    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import lr_scales_of, make_optimizer, selection_of, train_step

    model = torch_twin(spec.model, signature, spec.initial,
                       adapters=frozen).to(spec.device)
    optimizer = (make_optimizer(model, spec.optimizer, selection_of(signature),
                                lr_scales_of(signature)) if frozen
                 else make_optimizer(model, spec.optimizer))
    tensors = [torch.from_numpy(a).to(spec.device) for a in batch]
    # torch.compile: forward and backward compiled (Inductor, C++ on the CPU), the update
    # eager; compiling happens in the first warm-up step, outside the timed ones.
    net = torch.compile(model) if compile else model
    return lambda: train_step(net, optimizer, *tensors, task=signature["task"])


def peer_twin(model, initial: dict, signature, frozen: bool):
    """The twin of ``model`` (a config's model section) from ``initial`` that a peer trains
    (the plain model for full backpropagation; the scheme's, LoRA adapters and all, for the
    scheme) and the parameters it trains, by the source's names: whole tensors (a
    channel-selected parameter is trained whole, as other engines freeze tensors, not
    channels)."""
    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import selection_of

    twin = torch_twin(model, signature, initial, adapters=frozen)
    names = (list(selection_of(signature)) if frozen
             else [name for name, _ in twin.named_parameters()])
    return twin, names


def losses_beside_pytorch(peer_step, spec, signature, batch, steps: int, frozen: bool,
                          optimizer) -> tuple[list, list]:
    """A peer's losses over its first ``steps`` (``peer_step()`` runs one and returns its loss),
    and PyTorch's training what ``peer_twin`` gives with ``optimizer`` (a config's optimizer)
    from the same values on ``batch``: what ``check_losses`` returns."""
    from pipelines.models.pytorch import make_optimizer, train_step

    peer = [peer_step() for _ in range(steps)]
    twin, names = peer_twin(spec.model, spec.initial, signature, frozen)
    update = make_optimizer(twin, optimizer, names)
    return peer, [train_step(twin, update, *batch, task=signature["task"])
                  for _ in range(steps)]
