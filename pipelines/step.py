"""A built training step: a directory holding ``step.so`` and ``signature.json``. Compiling
one into place (``save_step``), loading it and holding the training state between steps
(``CompiledStep``).

Benchmark, fine-tuning and the tests call the compiled step through this one class.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import tvm
from tvm import relax

from pipelines.backends import compile_with_backends
from pipelines.tuning import schedule_cpu


LIBRARY, SIGNATURE = "step.so", "signature.json"


def save_step(mod: tvm.IRModule, signature: dict, target, directory: Path,
              measured_backends: bool = False, database=None) -> tuple[dict, Counter]:
    """Compile ``mod`` for ``target`` (this machine's CPU) into ``directory`` with its signature
    beside it. Its matrix products are generated code, or, with ``measured_backends``, on
    whichever backend measures faster here. Kernels with a record in ``database``
    (pipelines/tuning.py) take its schedule, the others the default one. Returns the backend
    measurements and how many kernels each schedule took (``tuned``, the default ones)."""
    directory, target = Path(directory), tvm.target.Target(target)
    mod, link, backends = compile_with_backends(mod, target, directory, measured_backends)
    mod, schedules = schedule_cpu(mod, target, database)
    tvm.compile(mod, target=target).export_library(str(directory / LIBRARY), **link)
    (directory / SIGNATURE).write_text(json.dumps(signature))
    return backends, schedules


class CompiledStep:
    """A loaded ``train_step`` plus its state (parameters, buffers, optimizer state)."""

    def __init__(self, build_dir: Path, initial: dict[str, np.ndarray]):
        build_dir = Path(build_dir)
        self.signature = json.loads((build_dir / SIGNATURE).read_text())
        self.device = tvm.cpu()
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(build_dir / LIBRARY)),
                                       self.device)
        self.function = self.vm["train_step"]
        self.state_names = self.signature["inputs"][2:]
        self.optimizer_state = self.signature["optimizer_state"]
        self.state = {name: tvm.runtime.tensor(value, self.device)
                      for name, value in initial_state(self.signature, initial).items()}
        # Output i (after the loss) is the new value of state entry updates[i].
        self.updates = [name.removeprefix("new_") for name in self.signature["outputs"][1:]]

    def arguments(self, x: np.ndarray, y: np.ndarray) -> list:
        return ([tvm.runtime.tensor(x, self.device), tvm.runtime.tensor(y, self.device)]
                + [self.state[n] for n in self.state_names])

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        outputs = self.function(*self.arguments(x, y))
        for name, value in zip(self.updates, list(outputs)[1:]):
            self.state[name] = value
        return float(outputs[0].numpy())

    def torch_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under their PyTorch names (for ``load_state_dict``)."""
        names = self.signature["torch_names"]
        return {names[n]: torch.from_numpy(v.numpy()) for n, v in self.state.items()
                if n in names}

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the step's weights and running statistics into ``model``. Only batch-norm
        ``num_batches_tracked`` counters are not carried (a fixed momentum never reads them)."""
        state = self.torch_state_dict()
        untracked = [k for k in model.state_dict() if k not in state
                     and not k.endswith("num_batches_tracked")]
        if untracked:
            raise KeyError(f"compiled step holds no value for {untracked}")
        model.load_state_dict(state, strict=False)
        return model

    def torch_optimizer(self, model: torch.nn.Module):
        """An optimizer over the step's trainable parameters of ``model``, with the same
        hyper-parameters and the compiled step's optimizer state loaded into it: a
        ``torch.optim`` one, or for a channel-sparse step a ``ChannelSparse`` whose
        slice-shaped state continues exactly where the compiled step stopped."""
        from pipelines.torch_ref import ChannelSparse

        spec = self.signature["optimizer"]

        def make(params):
            return getattr(torch.optim, spec["torch_class"])(params, **spec["kwargs"])

        selection = selection_of(self.signature)
        named = dict(model.named_parameters())
        if any(selection.values()):
            wrapper = ChannelSparse(named, selection, make)
            optimizer = wrapper.optimizer
        else:
            wrapper = optimizer = make([named[n] for n in selection])
        state = optimizer.state_dict()
        index = {p: i for i, p in enumerate(self.signature["trainable"])}
        per_param: dict[int, dict] = {i: {} for i in index.values()}
        shared = {}
        for name, info in self.optimizer_state.items():
            value = torch.from_numpy(self.state[name].numpy())
            if info["param"] is None:
                shared[info["torch"]] = value
            else:
                per_param[index[info["param"]]][info["torch"]] = value
        if self.optimizer_state:  # plain SGD has none
            # torch.optim increments each parameter's step count in place: one copy each.
            state["state"] = {i: slots | {k: v.clone() for k, v in shared.items()}
                              for i, slots in per_param.items()}
        optimizer.load_state_dict(state)
        return wrapper


def initial_state(signature: dict, initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The step's state before its first call, by input name: ``initial``'s parameters and
    buffers, and the optimizer state at zero, as in torch.optim."""
    state = {}
    for name in signature["inputs"][2:]:
        if name in signature["optimizer_state"]:
            info = signature["optimizer_state"][name]
            # A channel-sparse parameter's state holds only its selected channels.
            shape = info.get("shape", initial[info["param"]].shape if info["param"] else ())
            value = np.zeros(shape, "float32")
        else:
            value = initial[name]
        state[name] = np.array(value, order="C")
    return state


def initial_from(model: torch.nn.Module, signature: dict) -> dict[str, np.ndarray]:
    """The step's parameters and buffers (by their names in the step) from ``model``."""
    state = model.state_dict()
    return {r: state[t].numpy() for r, t in signature["torch_names"].items()}


def selection_of(signature: dict) -> dict[str, dict | None]:
    """The scheme's selection a step was built with, under PyTorch names (stages/prune/scheme.py:
    None for a whole parameter, {"axis", "index"} for some channels)."""
    names, channels = signature["torch_names"], signature.get("channels", {})
    return {names[p]: channels.get(p) for p in signature["trainable"]}


def load_initial(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}
