"""Append the loss, differentiate at compile time, and put the optimizer in the same graph.

The result is one Relax function, the whole training step:

    train_step(*inputs, labels, *params, *buffers, *optimizer_state)
        -> (loss, *new_params, *new_buffers, *new_optimizer_state)

Every output is named ``new_<input>`` in the signature, so later stages select by name.

Nothing is differentiated at run time. Every parameter is differentiated here; the prune stage
removes what a sparse scheme does not update. The steps, in order (as TVM's SetupTrainer):
check that every op has a gradient rule, append the loss (relax.training.AppendLoss), take the
gradient over the parameters only (relax.transform.Gradient), emit the optimizer's update in the
same dataflow block, inline the adjoint.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.training import AppendLoss

from pipelines.analysis.indices import index_rows
from pipelines.ir import PADDING_ROWS, dtype_of, shape_of, tensor_type
from pipelines.schema import ConfigError
from pipelines.tasks import IGNORE_INDEX
from pipelines.training import rules
from pipelines.training.loss import loss_function
from pipelines.training.optimizers import UPDATE_PREFIX

LABELS = "labels"  # the step's input after the model's own: what the loss scores (loss.py)


class MissingGradientRule(ConfigError):
    """An op of the model has no gradient rule: the message names it and the source layer."""


def build_train_step(main: relax.Function, num_params: int, optimizer,
                     origins: dict[str, str] | None = None, task: str = "classification",
                     lr_scales: dict[str, float] | None = None) -> tuple[relax.Function, dict]:
    """``main(*inputs, *params, *buffers) -> (logits, *new_buffers)`` -> the training step.

    ``optimizer`` is one of training/optimizers.py; ``task`` picks the loss and the labels
    (training/loss.py); ``lr_scales``, a parameter's (Relax name) learning-rate scale where it
    is not 1 (training/scheme.py: lr_scales). ``origins`` maps binding names to the
    source layer they came from (for error messages). Returns the function and its signature:
    input and output names in order (``data``: the model's inputs and the labels), and what
    each optimizer-state input holds. Precondition: take indices are 1-D
    (transform/flatten_take_indices.py)."""
    count = int(main.attrs["num_input"])
    missing = rules.ops_without_gradient(main, main.params[count:count + num_params])
    if missing:
        op, var = missing[0]
        layer = (origins or {}).get(var, "unknown layer")
        others = sorted({o for o, _ in missing[1:]} - {op})
        raise MissingGradientRule(
            f"operator {op} in layer {layer} (bound to {var}) has no gradient rule"
            + (f"; also without one: {', '.join(others)}" if others else "")
            + f"; register one in pipelines/training/rules.py (known rules: "
            f"{sorted(rules.RULES)} plus TVM's own)")
    inputs, params = main.params[:count], list(main.params[count:count + num_params])
    buffers = list(main.params[count + num_params:])
    if any(x.name == LABELS for x in inputs):
        raise ConfigError(f"the model takes an input named {LABELS!r}; the training step's "
                          "labels are its own input of that name: rename the model's")
    # embedding weights whose padding row PyTorch never updates (frontends/torch_program.py)
    padding = {str(k): int(v) for k, v in (main.attrs or {}).get(PADDING_ROWS, {}).items()}
    loss, labels_type = loss_function(task, main.body.body.fields[0].ty)
    mod = AppendLoss("main", loss, num_backbone_outputs=1)(tvm.IRModule({"main": main}))
    loss_fn = mod["main_loss"]
    mod = relax.transform.Gradient(
        "main_loss", require_grads=list(loss_fn.params[count:count + num_params]),
        target_index=0)(mod)
    adjoint = mod.get_global_var("main_loss_adjoint")

    y = relax.Var(LABELS, labels_type)
    sinputs = [relax.Var(x.name, x.ty) for x in inputs]
    sparams = [relax.Var(p.name, p.ty) for p in params]
    sbuffers = [relax.Var(b.name, b.ty) for b in buffers]
    # Optimizer state: per-parameter slots, then slots shared by all parameters (a step count).
    state_info, per_param, shared = {}, [], {}
    for p in sparams:
        slots = {slot: relax.Var(f"{slot}_{p.name}", p.ty) for slot in optimizer.slots}
        per_param.append(slots)
        for slot, var in slots.items():
            state_info[var.name] = {"param": p.name, "slot": slot,
                                    "torch": optimizer.slots[slot]}
    for slot, key in optimizer.global_slots.items():
        shared[slot] = relax.Var(f"optimizer_{slot}", tensor_type([], "float32"))
        state_info[shared[slot].name] = {"param": None, "slot": slot, "torch": key}
    state_vars = [v for slots in per_param for v in slots.values()] + list(shared.values())

    bb = relax.BlockBuilder(mod)
    with bb.function("train_step", sinputs + [y] + sparams + sbuffers + state_vars):
        with bb.dataflow():
            result = bb.emit(relax.Call(adjoint, sinputs + sparams + sbuffers + [y]))
            values = bb.emit(relax.TupleGetItem(result, 0))
            grads = bb.emit(relax.TupleGetItem(result, 1))
            # The loss function returns (loss, *new_buffers), or the bare loss without buffers.
            has_buffers = isinstance(values.ty, relax.TupleType)
            loss_out = bb.emit_output(relax.TupleGetItem(values, 0) if has_buffers else values)
            new_buffers = [bb.emit_output(relax.TupleGetItem(values, 1 + i))
                           for i in range(len(buffers))]
            new_shared, factors = optimizer.prepare(bb, shared)
            # per learning-rate scale, the factors of a torch.optim param group at lr * scale
            scaled = {}
            for scale in sorted(set((lr_scales or {}).values())):
                lr = bb.emit(relax.op.multiply(shared["lr"], relax.const(scale, "float32")),
                             name_hint="optimizer_lr_scaled")
                scaled[scale] = optimizer.prepare(bb, dict(shared, lr=lr))[1]
            new_params, new_state = [], {}
            for i, (w, slots) in enumerate(zip(sparams, per_param)):
                g = bb.emit(relax.TupleGetItem(grads, i))
                if w.name in padding:  # PyTorch's padding_idx row gets no gradient
                    g = bb.emit(relax.op.multiply(g, _row_mask(w, padding[w.name])))
                nw, ns = optimizer.update(bb, w.name, w, g, slots,
                                          scaled.get((lr_scales or {}).get(w.name), factors))
                new_params.append(bb.emit_output(nw, name_hint=f"{UPDATE_PREFIX}{w.name}"))
                for slot, var in slots.items():
                    new_state[var.name] = bb.emit_output(
                        ns[slot], name_hint=f"{UPDATE_PREFIX}{w.name}")
            for slot, var in shared.items():
                new_state[var.name] = bb.emit_output(new_shared[slot])
        bb.emit_func_output(relax.Tuple([loss_out] + new_params + new_buffers
                                        + [new_state[v.name] for v in state_vars]))
    mod = bb.get()
    # Inline the adjoint into train_step so one dataflow block holds forward, backward and update.
    mod["main_loss_adjoint"] = mod["main_loss_adjoint"].without_attr("global_symbol")
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination(["train_step"])(mod)
    step = mod["train_step"]
    data = [x.name for x in sinputs] + [LABELS]
    names = data + [p.name for p in sparams + sbuffers + state_vars]
    rows = index_rows(main, inputs)  # a token id's table: checked before a step, as labels
    signature = {
        "data": data,
        "task": task,
        "labels_shape": shape_of(y),  # a class per row; a token label per position; a target
        "data_types": {x.name: {"shape": shape_of(x), "dtype": dtype_of(x)}
                       | ({"rows": rows[x.name]} if x.name in rows else {})
                       for x in [*sinputs, y]},
        "inputs": names,
        "outputs": ["loss"] + [f"new_{n}" for n in names[len(data):]],
        "optimizer_state": state_info,
        "optimizer": {"torch_class": optimizer.torch_class, "kwargs": optimizer.torch_kwargs()},
        # what a label may be (runtime/checks.py): a class of the logits' last axis, or ignored
        "labels": {"classes": shape_of(main.body.body.fields[0].ty)[-1]
                   if task != "regression" else None, "ignore_index": IGNORE_INDEX},
    }
    return step, signature


def unreached_parameters(main: relax.Function, params) -> list[relax.Var]:
    """Those of ``params`` that no gradient from ``main``'s output (the logits) reaches:
    parameters the loss never reads (an unused pooler, a cross-attention a decoder-only model
    skips) or reads only through integers (a router's scores that only pick indices) or
    detached values, which PyTorch gives no gradient and no update."""
    reached = rules.gradient_reaches(main)
    return [p for p in params if p not in reached]


def _row_mask(weight: relax.Var, row: int) -> relax.Expr:
    """[rows, 1]: 1, but 0 at ``row``; times a gradient, it leaves ``row`` out of the update."""
    mask = np.ones((shape_of(weight)[0], 1), dtype_of(weight))
    mask[row] = 0
    return relax.const(mask)
