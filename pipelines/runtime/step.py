"""A built training step: a directory holding the step library and ``signature.json``. Loading
it and holding the training state between steps (``CompiledStep``).

Evaluation, fine-tuning, packaging and the tests call the compiled step through this one class.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import tvm
from tvm.runtime.vm import VirtualMachine  # the runtime's VM: no compiler needed to run a step

import pipelines.threads  # noqa: F401  (TVM's and OpenBLAS's thread counts, before they start)
from pipelines.io import read_json, verified
from pipelines.layout import SIGNATURE
from pipelines.runtime.checks import BadBatch, check_batch, check_finite, check_shapes
from pipelines.runtime.cuda import cuda_device, keep
from pipelines.stored_weights import SCALES, STORED_AS, as_stored, widened

LIBRARY, BUILT = "step.so", "build.json"


def built_for_cuda(build_dir: Path) -> bool:
    """Whether the step in ``build_dir`` runs its kernels on an NVIDIA GPU (its build's target)."""
    import json

    return json.loads(read_json(Path(build_dir) / BUILT)["target"])["kind"] == "cuda"


class CompiledStep:
    """A loaded ``train_step`` plus its state (parameters, buffers, optimizer state)."""

    def __init__(self, build_dir: Path, initial: dict[str, np.ndarray]):
        build_dir = Path(build_dir)
        self.signature = read_json(build_dir / SIGNATURE)
        # a CUDA build's state lives on the GPU, the VM's own bookkeeping on the CPU
        self.device = cuda_device() if built_for_cuda(build_dir) else tvm.cpu()
        self.vm = VirtualMachine(
            tvm.runtime.load_module(str(verified(build_dir / LIBRARY))), self.device)
        self.function = self.vm["train_step"]
        self.data = self.signature["data"]  # the step's data inputs: the model's, then labels
        self.state_names = self.signature["inputs"][len(self.data):]
        self.optimizer_state = self.signature["optimizer_state"]
        self.state = {name: tvm.runtime.tensor(value, self.device)
                      for name, value in initial_state(self.signature, initial).items()}
        # Output i (after the loss) is the new value of state entry updates[i].
        self.updates = [name.removeprefix("new_") for name in self.signature["outputs"][1:]]
        # a step built with optimize.update_in_place writes its new state over ``state``
        self.in_place = bool(self.signature.get("updated_in_place"))
        # a step replaying CUDA graphs reads its state from the tensors it captured: the state
        # stays in them (a new value is copied in, never rebound)
        self.resident = bool(read_json(build_dir / BUILT).get("cuda_graph"))
        self.steps = 0  # taken by ``step``

    def arguments(self, *data: np.ndarray) -> list:
        if len(data) != len(self.data):
            raise TypeError(f"the step takes {self.data}, got {len(data)} arrays")
        data = [np.ascontiguousarray(a) for a in data]
        check_shapes(self.signature["data_types"], dict(zip(self.data, data)),
                     f"step {self.steps + 1}")
        return ([tvm.runtime.tensor(a, self.device) for a in data]
                + [self.state[n] for n in self.state_names])

    def step(self, *data: np.ndarray) -> float:
        """One training step on a batch (the model's inputs, then the labels); the loss. A
        batch the step cannot take (labels out of range, non-finite inputs), or a loss or new
        state that is not finite, is a StepError naming the step and the array. The state stays
        as it was before the step, except after a step that updates it in place and went
        non-finite (runtime/checks.py)."""
        where = f"step {self.steps + 1}"
        check_batch(self.signature, dict(zip(self.data, data)), where)
        outputs = list(self.function(*self.arguments(*data)))
        names = self.signature["source_names"]
        check_finite({"loss": outputs[0].numpy(),
                      **{names.get(name, name): self._on_host(value)
                         for name, value in zip(self.updates, outputs[1:])}}, where,
                     self.in_place)
        for name, value in zip(self.updates, outputs[1:]):
            keep(self.state, name, value, self.resident)
        self.steps += 1
        return float(outputs[0].numpy())

    def set_state(self, name: str, value) -> None:
        """State entry ``name`` takes ``value`` (a tensor on the step's device), which must
        have its shape and dtype (the built step does not check: runtime/checks.py)."""
        old = self.state[name]
        if value.dtype != old.dtype or tuple(value.shape) != tuple(old.shape):
            raise BadBatch(f"state {name!r}: {value.dtype} {list(value.shape)}; allowed: "
                           f"{old.dtype} {list(old.shape)}")
        keep(self.state, name, value, self.resident)

    def _on_host(self, value) -> np.ndarray:
        """A state tensor as numpy: a view of it on the CPU, a copy from the GPU."""
        return np.from_dlpack(value) if self.device.dlpack_device_type() == 1 else value.numpy()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (a schedule's: the step takes it as state)."""
        for name, info in self.optimizer_state.items():
            if info["slot"] == "lr":
                self.set_state(name, tvm.runtime.tensor(np.array(lr, "float32"), self.device))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under their names in the source (for ``load_state_dict``),
        in float32 where the step stores a frozen weight narrower."""
        names, stored = self.signature["source_names"], self.signature.get(STORED_AS, {})
        read = names.keys() | self.signature.get(SCALES, {}).values()  # not the optimizer's
        state = {n: v.numpy() for n, v in self.state.items() if n in read}
        # a weight stored narrower goes back widened, as the step read it (torch has no numpy
        # bfloat16)
        return {names[n]: torch.from_numpy(widened(self.signature, n, state) if n in stored
                                           else v)
                for n, v in state.items() if n in names}

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the step's weights and running statistics into ``model``. Only batch-norm
        ``num_batches_tracked`` counters are not carried (a fixed momentum never reads them),
        and a tied parameter's other names (a head tied to the embeddings: the step holds it
        under one)."""
        state = self.state_dict()
        names: dict[int, set[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), set()).add(name)
        tied = {alias for same in names.values() if same & state.keys() for alias in same}
        untracked = [k for k in model.state_dict() if k not in state and k not in tied
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
        from pipelines.models.pytorch import (ChannelSparse, grouped, lr_scales_of,
                                              param_groups, selection_of)

        spec, scales = self.signature["optimizer"], lr_scales_of(self.signature)

        def make(params: dict):
            return getattr(torch.optim, spec["torch_class"])(
                param_groups(params, spec["kwargs"]["lr"], scales), **spec["kwargs"])

        selection = selection_of(self.signature)
        named = dict(model.named_parameters())
        if any(selection.values()):
            wrapper = ChannelSparse(named, selection, make)
            optimizer = wrapper.optimizer
        else:
            wrapper = optimizer = make({n: named[n] for n in selection})
        state = optimizer.state_dict()
        # the state dict numbers the parameters group by group (param_groups)
        trainable, names = self.signature["trainable"], self.signature["source_names"]
        by_group = grouped(trainable, {p: scales[names[p]] for p in trainable
                                       if names[p] in scales})
        index = {p: i for i, p in enumerate(p for group in by_group.values() for p in group)}
        per_param: dict[int, dict] = {i: {} for i in index.values()}
        shared = {}
        for name, info in self.optimizer_state.items():
            value = torch.from_numpy(self.state[name].numpy())
            if info["torch"] is None:  # the accumulated gradients: zero between steps
                continue
            if info["slot"] == "lr":  # a param_groups key, not state
                for group in state["param_groups"]:
                    group["lr"] = float(value) * group.get("lr_scale", 1.0)
            elif info["param"] is None:
                shared[info["torch"]] = value
            else:
                per_param[index[info["param"]]][info["torch"]] = value
        if any(info["slot"] != "lr" and info["torch"] for info in self.optimizer_state.values()):
            # torch.optim increments each parameter's step count in place: one copy each.
            state["state"] = {i: slots | {k: v.clone() for k, v in shared.items()}
                              for i, slots in per_param.items()}
        optimizer.load_state_dict(state)
        return wrapper


def initial_state(signature: dict, initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The step's state before its first call, by input name: ``initial``'s parameters and
    buffers (a weight the step stores narrower in its dtype: stored_weights.as_stored), and the
    optimizer state at zero, as in torch.optim."""
    initial = as_stored(signature, initial)
    state = {}
    for name in signature["inputs"][len(signature["data"]):]:
        if name in signature["optimizer_state"]:
            info = signature["optimizer_state"][name]
            # A channel-sparse parameter's state holds only its selected channels.
            shape = info.get("shape", initial[info["param"]].shape if info["param"] else ())
            value = np.zeros(shape, "float32")
            if info["slot"] == "lr":  # the configured learning rate, until a schedule sets it
                value = np.array(signature["optimizer"]["kwargs"]["lr"], "float32")
        else:
            value = initial[name]
        state[name] = np.array(value, order="C")
    return state


def synthetic_batch(signature: dict, seed: int, batches: int = 1) -> tuple[np.ndarray, ...]:
    """Seeded data of the step's inputs' shapes, ``batches`` batches along the first axis:
    normal floats, labels of class 0, other integers 1 (token ids past padding: id 0 is
    BERT's [PAD], and a model that masks padding out of a mean divides by zero on a row of
    it), an attention mask of ones (no position masked). What a step is run on where its
    numbers, not its data, are checked (a device against the host, a packaged image)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for name in signature["data"]:  # the step's order
        t = signature["data_types"][name]
        shape = [t["shape"][0] * batches, *t["shape"][1:]]
        fill = np.zeros if name == "labels" else np.ones
        arrays.append(rng.standard_normal(shape).astype(t["dtype"]) if "float" in t["dtype"]
                      else fill(shape, t["dtype"]))
    return tuple(arrays)
