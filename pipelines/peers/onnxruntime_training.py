"""What ONNX Runtime training's peers share (the `onnxruntime-training-cpu` package, its last
release 1.19.2, deprecated since: the engine users of on-device training are leaving). The
twin of the compiled step (the model's own module holding the step's initial values) is
exported to ONNX with each layer in its own mode (training-mode batch norms, frozen statistics
held), and ``generate_artifacts`` adds its loss, gradient graph and optimizer, with the
parameters outside the trained set frozen; its training API runs the steps, as an app would.

ONNX Runtime's optimizers are AdamW (set to torch.optim.AdamW's form) and plain SGD: a case with
momentum or weight decay is run with plain SGD at its learning rate, and its losses are checked against
PyTorch doing that same update (``first_losses``). It freezes whole tensors: a channel-sparse
parameter is trained whole, as PyTorch's frozen peer computes it. Its training graph runs every
batch norm in training mode, so a batch norm whose statistics the scheme holds is exported as
the arithmetic it computes (``held_norms_as_arithmetic``), as an ONNX Runtime user would write
it.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pipelines.peers.pytorch import losses_beside_pytorch, peer_twin

# ONNX Runtime 1.19 reads models up to this IR version; onnx 1.23 writes newer ones.
MAX_IR_VERSION = 10
TORCH_ADAMW = 0  # its AdamWOptimizer's adam_mode for torch.optim.AdamW's update
# What the exported model's output becomes before ONNX Runtime's loss (a cross entropy over
# rows, or a mean squared error), and the labels beside it: models/pytorch.py's task_loss.
TOKEN_TASKS = {"causal_lm": (lambda out: out[:, :-1].flatten(0, 1),
                             lambda labels: labels[:, 1:].reshape(-1)),
               "masked_lm": (lambda out: out.flatten(0, 1), lambda labels: labels.reshape(-1))}
TASKS = ("classification", "regression", *TOKEN_TASKS)
IMPORTS = ("onnxruntime.training.api",)


def cannot_time(signature: dict, model) -> str | None:
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None or not importlib.util.find_spec(
            "onnxruntime.training"):
        return "onnxruntime-training is not installed: pip install -e '.[peers]'"
    if signature["task"] not in TASKS:
        return (f"ONNX Runtime training's losses here are {', '.join(TASKS)}; this case's task "
                f"is {signature['task']}")
    optimizer = signature["optimizer"]["torch_class"]
    if optimizer not in ("SGD", "AdamW"):
        return f"ONNX Runtime training has SGD and AdamW optimizers, not {optimizer}"
    return None


def optimizer_run(optimizer):
    """The update ONNX Runtime runs for the case's ``optimizer`` (a config's optimizer):
    plain SGD for SGD with momentum or weight decay; AdamW as it is."""
    if optimizer.kind == "sgd":
        return optimizer.model_copy(update={"momentum": 0.0, "nesterov": False,
                                            "weight_decay": 0.0})
    return optimizer


def held_norms_as_arithmetic(model):
    """``model`` with each batch norm in eval mode (its statistics held) replaced by its
    arithmetic on the same parameters and statistics (the same names in the export)."""
    import torch

    from pipelines.models.pytorch import batch_norms

    class HeldNorm(torch.nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps
            self.register_buffer("running_mean", norm.running_mean)
            self.register_buffer("running_var", norm.running_var)

        def forward(self, x):
            shape = (1, -1) + (1,) * (x.dim() - 2)
            scale = torch.rsqrt(self.running_var + self.eps).reshape(shape)
            normed = (x - self.running_mean.reshape(shape)) * scale
            return normed * self.weight.reshape(shape) + self.bias.reshape(shape)

    for name in batch_norms(model, training=False):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, HeldNorm(getattr(owner, child)))
    return model


def ort_step(spec, signature, batch, frozen: bool):
    """One ONNX Runtime training step (forward, backward, optimizer, gradients reset) as a
    callable returning its loss: every parameter trained, or with ``frozen`` the scheme's."""
    import onnxruntime
    from onnxruntime.training import api

    onnxruntime.set_default_logger_severity(3)  # its graph passes log each step at info
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = spec.cores
    with tempfile.TemporaryDirectory(prefix="pock-ort-") as tmp:
        directory = Path(tmp)
        write_training_artifacts(spec.model, spec.initial, signature, batch, frozen,
                                 spec.optimizer, directory)
        state = api.CheckpointState.load_checkpoint(str(directory / "checkpoint"))
        module = api.Module(str(directory / "training_model.onnx"), state,
                            session_options=options)
        optimizer = api.Optimizer(str(directory / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(spec.optimizer.lr)
    module.train()
    inputs, labels = training_inputs(signature, batch)

    def step() -> float:
        loss = module(*inputs, labels)
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)
    return step


def write_training_artifacts(model_section, initial: dict, signature: dict, batch,
                             frozen: bool, optimizer, directory: Path) -> tuple:
    """ONNX Runtime's training artifacts (training_model.onnx, checkpoint, optimizer_model.onnx)
    of the peer's twin of ``model_section`` from ``initial`` into ``directory``: every
    parameter trained, or with ``frozen`` the scheme's; the twin, and the names it trains."""
    model, names = peer_twin(model_section, initial, signature, frozen)
    _write_artifacts(model, model_section.source, signature, batch, names, directory, optimizer)
    return model, names


def training_inputs(signature: dict, batch) -> tuple[list, object]:
    """The training model's inputs and labels for the step's ``batch``: a token task's labels
    as rows, as the exported output is; integer labels as int64."""
    import numpy as np

    *inputs, labels = batch
    task = signature["task"]
    if task in TOKEN_TASKS:
        labels = TOKEN_TASKS[task][1](labels)
    return inputs, labels.astype(np.int64) if labels.dtype.kind in "iu" else labels


def _write_artifacts(model, source: str, signature: dict, batch, names: list[str],
                     directory: Path, optimizer) -> None:
    """The training model, checkpoint and optimizer model of ``model`` (the twin, exported
    from ``source``) training ``names`` with ``optimizer`` into ``directory``."""
    import io
    import warnings

    import onnx
    import torch
    from onnxruntime.training import artifacts, onnxblock

    from pipelines.tasks import IGNORE_INDEX

    model = held_norms_as_arithmetic(model.train())
    if signature["task"] in TOKEN_TASKS:  # a hook keeps the parameters' names in the export
        rows = TOKEN_TASKS[signature["task"]][0]
        model.register_forward_hook(lambda module, args, out: rows(out))
    inputs = tuple(torch.from_numpy(a) for a in batch[:-1])
    exported = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notices
        warnings.simplefilter("ignore")
        # The TorchScript exporter: its TrainingMode keeps batch norms in training mode, with
        # their names on the initializers that generate_artifacts is told to train.
        torch.onnx.export(model, inputs, exported, input_names=signature["data"][:-1],
                          output_names=["output"], do_constant_folding=False, dynamo=False,
                          training=torch.onnx.TrainingMode.PRESERVE)
    graph = onnx.load_from_string(exported.getvalue())
    for node in graph.graph.node:  # ORT's gradient of a layer norm reads its optional outputs
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.name}.mean", f"{node.name}.inv_std_dev"])
    initializers = {i.name for i in graph.graph.initializer}
    missing = sorted(set(names) - initializers)
    if missing:
        raise RuntimeError(f"the ONNX export of {source} has no initializer for the "
                           f"trained parameters {missing[:5]}")
    loss = (onnxblock.loss.MSELoss() if signature["task"] == "regression"
            else onnxblock.loss.CrossEntropyLoss(ignore_index=IGNORE_INDEX))
    update = (onnxblock.optim.AdamW(betas=tuple(optimizer.betas), eps=optimizer.eps,
                                    weight_decay=optimizer.weight_decay)
              if optimizer.kind == "adamw" else onnxblock.optim.SGD())
    with _native_stderr_silenced():  # its gradient builder logs every graph pass at info
        artifacts.generate_artifacts(graph, requires_grad=names,
                                     frozen_params=sorted(initializers - set(names)), loss=loss,
                                     optimizer=update, artifact_directory=directory)
    for name in ("training_model.onnx", "optimizer_model.onnx"):
        written = onnx.load(directory / name)
        written.ir_version = min(written.ir_version, MAX_IR_VERSION)
        for node in written.graph.node:  # its block writes Hugging Face's form (adam_mode 1)
            if node.op_type == "AdamWOptimizer":
                for attribute in node.attribute:
                    if attribute.name == "adam_mode":
                        attribute.i = TORCH_ADAMW
        onnx.save(written, directory / name)


@contextmanager
def _native_stderr_silenced():
    """File descriptor 2 to /dev/null meanwhile (native code's logging; errors still come
    back as Python exceptions)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def first_losses(spec, signature, batch, steps: int, frozen: bool) -> tuple[list, list]:
    """The peer's first losses and PyTorch's doing the same update (``optimizer_run``'s)."""
    return losses_beside_pytorch(ort_step(spec, signature, batch, frozen), spec, signature, batch,
                                 steps, frozen, optimizer_run(spec.optimizer))
