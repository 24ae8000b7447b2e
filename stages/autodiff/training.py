"""Append the loss, differentiate at compile time, and put the optimizer in the same graph.

The result is one Relax function, the whole training step:

    train_step(x, y, *params, *buffers, *momenta)
        -> (loss, *new_params, *new_momenta, *new_buffers)

Nothing is differentiated at run time. Every parameter is differentiated here; the prune stage
removes what a sparse scheme does not update.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.training import AppendLoss
from tvm.relax.training.loss import CrossEntropyLoss

from pipelines.ir import dtype_of, tensor_type
from stages.autodiff import rules


@dataclass(frozen=True)
class SGD:
    """PyTorch's SGD (dampening 0): g += wd*w; m = mu*m + g; w -= lr*m.

    Momentum starts at zero, which matches PyTorch's first step (m = g) exactly."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def update(self, bb: relax.BlockBuilder, w, g, m):
        dtype = dtype_of(w)
        if self.weight_decay:
            g = bb.emit(relax.op.add(g, relax.op.multiply(w, relax.const(self.weight_decay,
                                                                          dtype))))
        m = bb.emit(relax.op.add(relax.op.multiply(m, relax.const(self.momentum, dtype)), g))
        w = bb.emit(relax.op.subtract(w, relax.op.multiply(m, relax.const(self.lr, dtype))))
        return w, m


class MissingGradientRule(Exception):
    pass


def build_train_step(main: relax.Function, num_params: int, optimizer: SGD,
                     origins: dict[str, str] | None = None) -> tuple[relax.Function, dict]:
    """``main(x, *params, *buffers) -> (logits, *new_buffers)`` -> the training-step function.

    ``origins`` maps binding names to the PyTorch module they came from (for error messages).
    Returns the function and its signature: input and output names in order."""
    missing = rules.ops_without_gradient(main)
    if missing:
        op, var = missing[0]
        layer = (origins or {}).get(var, "unknown layer")
        others = sorted({o for o, _ in missing[1:]} - {op})
        raise MissingGradientRule(
            f"operator {op} in layer {layer} (bound to {var}) has no gradient rule"
            + (f"; also without one: {', '.join(others)}" if others else "")
            + f"; register one in stages/autodiff/rules.py (known rules: {sorted(rules.RULES)} "
            "plus TVM's own)")
    x, params = main.params[0], list(main.params[1:1 + num_params])
    buffers = list(main.params[1 + num_params:])
    logits_type = main.body.body.fields[0].ty
    batch = int(logits_type.shape.values[0])

    mod = tvm.IRModule({"main": main})
    loss = CrossEntropyLoss(reduction="mean")(logits_type, tensor_type([batch], "int64"))
    mod = AppendLoss("main", loss, num_backbone_outputs=1)(mod)
    loss_fn = mod["main_loss"]
    mod = relax.transform.Gradient("main_loss", require_grads=list(loss_fn.params[1:1 + num_params]),
                                   target_index=0)(mod)
    adjoint = mod.get_global_var("main_loss_adjoint")

    y = relax.Var("y", tensor_type([batch], "int64"))
    sx = relax.Var(x.name, x.ty)
    sparams = [relax.Var(p.name, p.ty) for p in params]
    sbuffers = [relax.Var(b.name, b.ty) for b in buffers]
    momenta = [relax.Var(f"m_{p.name}", p.ty) for p in params]
    bb = relax.BlockBuilder(mod)
    with bb.function("train_step", [sx, y] + sparams + sbuffers + momenta):
        with bb.dataflow():
            result = bb.emit(relax.Call(adjoint, [sx] + sparams + sbuffers + [y]))
            values = bb.emit(relax.TupleGetItem(result, 0))
            grads = bb.emit(relax.TupleGetItem(result, 1))
            loss_out = bb.emit_output(relax.TupleGetItem(values, 0))
            new_params, new_momenta = [], []
            for i, (w, m) in enumerate(zip(sparams, momenta)):
                g = bb.emit(relax.TupleGetItem(grads, i))
                nw, nm = optimizer.update(bb, w, g, m)
                new_params.append(bb.emit_output(nw))
                new_momenta.append(bb.emit_output(nm))
            new_buffers = [bb.emit_output(relax.TupleGetItem(values, 1 + i))
                           for i in range(len(buffers))]
        bb.emit_func_output(relax.Tuple([loss_out] + new_params + new_momenta + new_buffers))
    mod = bb.get()
    # Inline the adjoint into train_step so one dataflow block holds forward, backward and update.
    mod["main_loss_adjoint"] = mod["main_loss_adjoint"].without_attr("global_symbol")
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["train_step"])(mod)
    step = mod["train_step"]
    signature = {
        "inputs": ["x", "y"] + [p.name for p in params] + [b.name for b in buffers]
                  + [m.name for m in momenta],
        "outputs": ["loss"] + [f"new_{p.name}" for p in params]
                   + [f"new_{m.name}" for m in momenta] + [f"new_{b.name}" for b in buffers],
    }
    return step, signature
