"""Peers in a device's container (a docker profile's ``docker.peers``). PyTorch's: the case's
PyTorch twin from the step's initial values (for PEFT LoRA, the plain twin with PEFT's
adapters), exported with its loss by torch.export (for ``torch.compile``, compiled there by
Inductor, in an image with g++ and the headers it needs), trained in the PyTorch image in the
same core and memory limits as the compiled step (runners/docker.py), with the optimizer and
trainable set the peer has on the host (pipelines/peers). On an 8 GiB board the question is
whether the step fits at all: its verdict (ok / out_of_memory) and its process's peak, measured
as the compiled step's are. Its first loss is checked against the host build's on the same
batch; its step times are this machine's cores, labelled container. The TensorFlow peers' step
is saved here as a SavedModel and run by TensorFlow's runtime in an image of TensorFlow; the
TFLite peers' model is converted here and trained by LiteRT's interpreter in an image of LiteRT
and numpy; ONNX
Runtime's training artifacts are made here and run by its training API in an image of ONNX
Runtime and numpy; ExecuTorch's program is made here and run by its runtime in the PyTorch image
with ExecuTorch. A peer that cannot do the case (PEFT LoRA of a case without adapters, TFLite of
a model other than MobileNetV2) is recorded as not run, with the reason.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from pipelines.models.pytorch import lr_scales_of, make_optimizer, task_loss
from pipelines.peers.pytorch import peer_twin
from pipelines.runtime.agreement import RTOL


class _WithLoss(torch.nn.Module):
    """The model and the task's loss, one module to export: called on the step's batch (the
    model's inputs, then the labels), it returns the loss."""

    def __init__(self, model: torch.nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, *batch):
        *inputs, labels = batch
        return task_loss(self.task, self.model(*inputs), labels)


def optimizer_plan(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer`` as peer_in_container.py rebuilds it: its class, and each param group's
    settings with its parameters by every name ``module`` has for them."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {"optimizer": type(optimizer).__name__,
            "groups": [{**{k: v for k, v in group.items() if k != "params"},
                        "params": [names[id(p)] for p in group["params"]]}
                       for group in optimizer.param_groups]}


def trained_module(peer: str, model, signature: dict, initial: dict, optimizer):
    """The module ``peer`` trains from ``initial`` and its torch.optim update, as on the host."""
    if peer == "peft_lora":
        from pipelines.peers.peft_lora import peft_model

        twin, names = peft_model(model, signature, initial)
        return twin, make_optimizer(twin, optimizer, names)
    frozen = IN_CONTAINER[peer][1]
    twin, names = peer_twin(model, initial, signature, frozen)
    return twin, make_optimizer(twin, optimizer, names,
                                lr_scales_of(signature) if frozen else None)


def export_peer(peer: str, model, signature: dict, initial: dict, optimizer, batch: tuple,
                out: Path) -> dict:
    """``peer``'s module and loss saved to ``out`` (torch.export), and its optimizer's plan."""
    twin, update = trained_module(peer, model, signature, initial, optimizer)
    wrapped = _WithLoss(twin, signature["task"]).train()
    program = torch.export.export(wrapped, tuple(torch.from_numpy(np.ascontiguousarray(a))
                                                 for a in batch))
    torch.export.save(program, out)
    return {**optimizer_plan(wrapped, update), "compile": peer in COMPILED}


def run_peers(profile, peers: list[str], model, signature: dict, initial: dict, optimizer,
              batch: tuple, loss_host: float, warmup: int, steps: int) -> dict:
    """Each of ``peers`` trained in the profile's container: its verdict, peak, first loss
    against the host build's ``loss_host``, and step times; a peer that fails is recorded
    with its error."""
    from pipelines.peers import why_not
    from pipelines.runtime.images import OutOfMemory

    results = {}
    for peer in peers:
        reason = why_not(peer, signature, model)
        if reason is not None:
            results[peer] = {"verdict": "not_run", "reason": reason}
            continue
        try:
            run, frozen = IN_CONTAINER[peer]
            ran = run(peer, frozen, profile, model, signature, initial, optimizer, batch,
                      warmup, steps)
        except OutOfMemory as err:
            results[peer] = {"verdict": "out_of_memory", "memory_mb": profile.memory_mb,
                             "reason": str(err).splitlines()[0]}
            continue
        except Exception as err:  # the table says why: the error and its last line
            lines = [line for line in str(err).splitlines() if line.strip()] or [""]
            results[peer] = {"verdict": "failed", "reason": f"{type(err).__name__}: "
                             + " ... ".join(dict.fromkeys([lines[0], lines[-1]]))}
            continue
        loss, times = ran["losses"][0], ran["times_ms"]
        results[peer] = {
            "verdict": "ok", "peak_rss_bytes": ran["peak_rss_bytes"], "image": ran["image"],
            "loss": loss, "loss_host": loss_host, "losses": ran["losses"],
            "matches_host": bool(abs(loss - loss_host) <= RTOL * abs(loss_host)),
            "trained": ran["trained"], "trained_elements": ran["trained_elements"],
            "container": {"median_ms": float(np.median(times)),
                          "p90_ms": float(np.percentile(times, 90)), "steps": len(times)}}
    return results


def _run_pytorch(peer, frozen, profile, model, signature, initial, optimizer, batch, warmup, steps):
    """A PyTorch peer: its program exported here, trained by peer_in_container.py."""
    from pipelines.runtime.runners.docker import run_peer

    with tempfile.TemporaryDirectory(prefix="pock-peer-") as tmp:
        program = Path(tmp) / "program.pt2"
        plan = export_peer(peer, model, signature, initial, optimizer, batch, program)
        return run_peer(program, plan, list(batch), profile, warmup, steps)


def _run_tensorflow(peer, frozen, profile, model, signature, initial, optimizer, batch, warmup,
                    steps):
    """A TensorFlow peer: its step saved here as a SavedModel (traced ahead of time, as an
    app's model is), run by TensorFlow's runtime in the container (tensorflow_in_container.py);
    it trains what PyTorch's twin of the same scheme trains."""
    from pipelines.peers.tensorflow_step import channels_last, saved_step
    from pipelines.runtime.runners.docker import run_tensorflow_peer

    with tempfile.TemporaryDirectory(prefix="pock-peer-") as tmp:
        saved = Path(tmp) / "saved_model"
        saved_step(_spec(profile, initial, model, optimizer, warmup, steps), signature, frozen,
                   batch, saved)
        x, labels = channels_last(batch)
        ran = run_tensorflow_peer(saved, {"x": x, "labels": labels}, profile, warmup, steps)
    return {**ran, **_trained(*peer_twin(model, initial, signature, frozen))}


def _run_tflite(peer, frozen, profile, model, signature, initial, optimizer, batch, warmup, steps):
    """A TFLite peer: its model converted here (as a phone's is, ahead of time), trained by
    LiteRT's interpreter in the container (tflite_in_container.py); it trains what PyTorch's
    twin of the same scheme trains."""
    from pipelines.peers.tensorflow_step import channels_last
    from pipelines.peers.tflite_training import converted
    from pipelines.runtime.runners.docker import run_tflite_peer

    spec = _spec(profile, initial, model, optimizer, warmup, steps)
    x, labels = channels_last(batch)
    ran = run_tflite_peer(converted(spec, signature, frozen, batch), {"x": x, "labels": labels},
                          profile, warmup, steps)
    return {**ran, **_trained(*peer_twin(model, initial, signature, frozen))}


def _run_ort(peer, frozen, profile, model, signature, initial, optimizer, batch, warmup, steps):
    """An ONNX Runtime training peer: its artifacts made here (as an app's are, ahead of time),
    run by ONNX Runtime's training API in the container (ort_in_container.py)."""
    from pipelines.peers.onnxruntime_training import training_inputs, write_training_artifacts
    from pipelines.runtime.runners.docker import run_ort_peer

    with tempfile.TemporaryDirectory(prefix="pock-peer-") as tmp:
        artifacts = Path(tmp)
        twin, names = write_training_artifacts(model, initial, signature, batch, frozen,
                                               optimizer, artifacts)
        inputs, labels = training_inputs(signature, batch)
        ran = run_ort_peer(artifacts, [*inputs, labels], optimizer.lr, profile, warmup, steps)
    return {**ran, **_trained(twin, names)}


def _run_executorch(peer, frozen, profile, model, signature, initial, optimizer, batch, warmup,
                    steps):
    """An ExecuTorch training peer: its program made here (as an app's is, ahead of time), run
    by ExecuTorch's runtime in the container (executorch_in_container.py)."""
    from pipelines.peers.executorch_training import training_program
    from pipelines.runtime.runners.docker import run_executorch_peer

    program, twin, names = training_program(model, initial, signature, batch, frozen)
    ran = run_executorch_peer(program, list(batch), optimizer, profile, warmup, steps)
    return {**ran, **_trained(twin, names)}


def _spec(profile, initial: dict, model, optimizer, warmup: int, steps: int):
    """The TensorFlow peers' view of the case (evaluate/speed.py's Spec): what their step is
    traced from."""
    from pipelines.evaluate.speed import Spec

    return Spec(cores=profile.cores, warmup=warmup, steps=steps, batch=Path(), build=Path(),
                initial=initial, model=model, optimizer=optimizer)


def _trained(twin, names: list[str]) -> dict:
    """What a peer whose script does not count it trains: ``names`` of ``twin``."""
    params = dict(twin.named_parameters())
    return {"trained": len(names), "trained_elements": sum(params[n].numel() for n in names)}


# The PyTorch peers whose exported program torch.compile compiles in the container
COMPILED = {"torch_compile_full"}
# The peers that train in a container: what runs each, and whether it trains the scheme's model
# with its frozen layers frozen (None: PEFT's adapters on the plain model).
IN_CONTAINER = {"torch_eager_full": (_run_pytorch, False),
                "torch_eager_frozen": (_run_pytorch, True),
                "torch_compile_full": (_run_pytorch, False), "peft_lora": (_run_pytorch, None),
                "tensorflow_full": (_run_tensorflow, False),
                "tensorflow_frozen": (_run_tensorflow, True),
                "tflite_full": (_run_tflite, False), "tflite_frozen": (_run_tflite, True),
                "ort_training_full": (_run_ort, False), "ort_training_frozen": (_run_ort, True),
                "executorch_full": (_run_executorch, False),
                "executorch_frozen": (_run_executorch, True)}
