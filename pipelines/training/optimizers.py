"""Optimizers compiled into the training step, with the exact update rules of ``torch.optim``
(each class's docstring gives its update as plain arithmetic).

An optimizer's state is explicit: per-parameter slots (named ``<slot>_<param>``) and global
slots (a step counter; the learning rate, so that a schedule sets it each step without a new
build) are inputs of the step, and their new values are outputs (the learning rate's, itself). Every update
binding is named ``opt_<param>...`` so later passes (update reordering, the memory breakdown)
can find the update of each parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import relax
from tvm.relax.op import add, astype, divide, multiply, power, sqrt, subtract

from pipelines.ir import dtype_of

UPDATE_PREFIX = "opt_"


def _const(value: float, like) -> relax.Constant:
    return relax.const(value, dtype_of(like))


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD (dampening 0): g += wd*w; b = mu*b + g; g = g + mu*b if nesterov else b;
    w -= lr*g. The buffer starts at zero, which gives PyTorch's first step (b = g) exactly."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    torch_class = "SGD"

    @property
    def slots(self) -> dict[str, str]:
        """Per-parameter state: slot -> key in torch.optim's state dict."""
        return {"m": "momentum_buffer"} if self.momentum else {}

    @property
    def global_slots(self) -> dict[str, str]:
        return {"lr": "lr"}  # slot -> torch.optim's name (the lr is a param_groups key)

    def prepare(self, bb, state: dict) -> tuple[dict, dict]:
        return {"lr": state["lr"]}, {"lr": state["lr"]}

    def update(self, bb, name: str, w, g, state: dict, shared: dict):
        emit = _emitter(bb, name)
        if self.weight_decay:
            g = emit(add(g, multiply(w, _const(self.weight_decay, w))))
        new_state = {}
        if self.momentum:
            b = emit(add(multiply(state["m"], _const(self.momentum, w)), g))
            new_state["m"] = b
            g = emit(add(g, multiply(b, _const(self.momentum, w)))) if self.nesterov else b
        return emit(subtract(w, multiply(g, shared["lr"]))), new_state

    def torch_kwargs(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov}


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam, or AdamW when ``decoupled`` (weight decay applied to w, not to g):
    t += 1; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
    w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
    The bias corrections are computed once per step in float64, as PyTorch does on the host."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    @property
    def torch_class(self) -> str:
        return "AdamW" if self.decoupled else "Adam"

    @property
    def slots(self) -> dict[str, str]:
        return {"m": "exp_avg", "v": "exp_avg_sq"}

    @property
    def global_slots(self) -> dict[str, str]:
        return {"step": "step", "lr": "lr"}

    def prepare(self, bb, state: dict) -> tuple[dict, dict]:
        """Emit the new step count and this step's bias-correction factors, and the decoupled
        weight decay's factor (float32 scalars, from the step's learning rate)."""
        emit = _emitter(bb, "step")
        step = emit(add(state["step"], relax.const(1.0, "float32")))
        t = emit(astype(step, "float64"))
        lr = emit(astype(state["lr"], "float64"))

        def correction(beta):
            return emit(subtract(relax.const(1.0, "float64"),
                                 power(relax.const(beta, "float64"), t)))

        c1, c2 = correction(self.beta1), correction(self.beta2)
        factors = {"step_size": emit(astype(divide(lr, c1), "float32")),
                   "c2_sqrt": emit(astype(sqrt(c2), "float32"))}
        if self.weight_decay and self.decoupled:
            factors["decay"] = emit(astype(subtract(relax.const(1.0, "float64"), multiply(
                lr, relax.const(self.weight_decay, "float64"))), "float32"))
        return {"step": step, "lr": state["lr"]}, factors

    def update(self, bb, name: str, w, g, state: dict, shared: dict):
        emit = _emitter(bb, name)
        if self.weight_decay and self.decoupled:
            w = emit(multiply(w, shared["decay"]))
        elif self.weight_decay:
            g = emit(add(g, multiply(w, _const(self.weight_decay, w))))
        m = emit(add(state["m"], multiply(subtract(g, state["m"]), _const(1 - self.beta1, w))))
        v = emit(add(multiply(state["v"], _const(self.beta2, w)),
                     multiply(multiply(g, g), _const(1 - self.beta2, w))))
        denom = emit(add(divide(sqrt(v), shared["c2_sqrt"]), _const(self.eps, w)))
        new_w = emit(subtract(w, multiply(divide(m, denom), shared["step_size"])))
        return new_w, {"m": m, "v": v}

    def torch_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps,
                "weight_decay": self.weight_decay}


@dataclass(frozen=True)
class Accumulating:
    """``inner`` stepping once every ``steps`` calls, on the mean of their gradients, as
    PyTorch does with each batch's loss divided by ``steps`` and ``backward`` summing into
    ``.grad``: a = a + g/steps every call; on the last call of each ``steps`` the update is
    ``inner``'s on a, and a starts again at zero; on the others the weights and ``inner``'s
    state go out as they came in (``where``, so bit-identical). The count of calls so far is
    state too, so the step needs nothing more from the caller. The update is computed on every
    call (one function, no control flow); its result is kept on the last."""

    inner: SGD | Adam
    steps: int

    @property
    def lr(self) -> float:
        return self.inner.lr

    @property
    def torch_class(self) -> str:
        return self.inner.torch_class

    @property
    def slots(self) -> dict[str, str | None]:  # None: no torch.optim state of that name
        return {**self.inner.slots, "grad_sum": None}

    @property
    def global_slots(self) -> dict[str, str | None]:
        return {**self.inner.global_slots, "accumulated": None}

    def prepare(self, bb, state: dict) -> tuple[dict, dict]:
        emit = _emitter(bb, "accumulated")
        count = emit(add(state["accumulated"], relax.const(1.0, "float32")))
        stepping = emit(relax.op.greater_equal(count, relax.const(float(self.steps), "float32")))
        new_inner, factors = self.inner.prepare(bb, state)
        new_state = {slot: emit(relax.op.where(stepping, value, state[slot]))
                     for slot, value in new_inner.items()}
        new_state["accumulated"] = emit(relax.op.where(stepping, relax.const(0.0, "float32"),
                                                       count))
        return new_state, {**factors, "stepping": stepping}

    def update(self, bb, name: str, w, g, state: dict, shared: dict):
        emit = _emitter(bb, name)
        total = emit(add(state["grad_sum"], multiply(g, _const(1 / self.steps, g))))
        new_w, new_inner = self.inner.update(bb, name, w, total, state, shared)
        stepping = shared["stepping"]
        new_state = {slot: emit(relax.op.where(stepping, value, state[slot]))
                     for slot, value in new_inner.items()}
        new_state["grad_sum"] = emit(relax.op.where(stepping, _const(0.0, g), total))
        return emit(relax.op.where(stepping, new_w, w)), new_state

    def torch_kwargs(self) -> dict:
        return self.inner.torch_kwargs()


def _emitter(bb, name: str):
    def emit(expr):
        return bb.emit(expr, name_hint=f"{UPDATE_PREFIX}{name}")
    return emit


def from_config(optimizer):
    """The compiled optimizer for a pipelines/config.py optimizer (SGD or Adam, checked there),
    accumulating its gradient_accumulation_steps batches' gradients where that is over 1."""
    if optimizer.kind == "sgd":
        inner = SGD(lr=optimizer.lr, momentum=optimizer.momentum,
                    weight_decay=optimizer.weight_decay, nesterov=optimizer.nesterov)
    else:
        beta1, beta2 = optimizer.betas
        inner = Adam(lr=optimizer.lr, beta1=beta1, beta2=beta2, eps=optimizer.eps,
                     weight_decay=optimizer.weight_decay, decoupled=optimizer.kind == "adamw")
    steps = optimizer.gradient_accumulation_steps
    return Accumulating(inner, steps) if steps > 1 else inner
