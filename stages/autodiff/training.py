"""Append the loss, differentiate at compile time, and put the optimizer in the same graph.

The result is one Relax function, the whole training step:

    train_step(x, y, *params, *buffers, *optimizer_state)
        -> (loss, *new_params, *new_buffers, *new_optimizer_state)

Every output is named ``new_<input>`` in the signature, so later stages select by name.

Nothing is differentiated at run time. Every parameter is differentiated here; the prune stage
removes what a sparse scheme does not update.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.training import AppendLoss
from tvm.relax.training.loss import CrossEntropyLoss

from pipelines.ir import dtype_of, shape_of, tensor_type
from stages.autodiff import rules
from stages.autodiff.optimizers import UPDATE_PREFIX


class MissingGradientRule(Exception):
    pass


def flatten_take_indices(func: relax.Function) -> relax.Function:
    """Each ``take`` with indices that are not 1-D (an embedding lookup of a (batch, seq) token
    grid, or one row by a scalar index) as a reshape to 1-D indices, the take, and a reshape
    back: TVM's take gradient (take_backward) handles 1-D indices only. Same values."""
    builder = relax.BlockBuilder()
    blocks = []
    for block in func.body.blocks:
        bindings = []
        for b in block.bindings:
            value = b.value
            if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    and value.op.name == "relax.take" and len(shape_of(value.args[1])) != 1):
                data, indices = value.args
                count = math.prod(shape_of(indices))
                flat = relax.DataflowVar(f"{b.var.name}_indices",
                                         tensor_type([count], dtype_of(indices)))
                bindings.append(relax.VarBinding(flat, builder.normalize(
                    relax.op.reshape(indices, [count]))))
                rows = builder.normalize(relax.op.take(data, flat, axis=int(value.attrs.axis),
                                                       mode=str(value.attrs.mode)))
                taken = relax.DataflowVar(f"{b.var.name}_rows", rows.ty)
                bindings.append(relax.VarBinding(taken, rows))
                value = builder.normalize(relax.op.reshape(taken, shape_of(b.var)))
            bindings.append(relax.VarBinding(b.var, value))
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def build_train_step(main: relax.Function, num_params: int, optimizer,
                     origins: dict[str, str] | None = None) -> tuple[relax.Function, dict]:
    """``main(x, *params, *buffers) -> (logits, *new_buffers)`` -> the training-step function.

    ``optimizer`` is one of stages/autodiff/optimizers.py. ``origins`` maps binding names to the
    PyTorch module they came from (for error messages). Returns the function and its signature:
    input and output names in order, and what each optimizer-state input holds."""
    main = flatten_take_indices(main)
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
    with bb.function("train_step", [sx, y] + sparams + sbuffers + state_vars):
        with bb.dataflow():
            result = bb.emit(relax.Call(adjoint, [sx] + sparams + sbuffers + [y]))
            values = bb.emit(relax.TupleGetItem(result, 0))
            grads = bb.emit(relax.TupleGetItem(result, 1))
            # The loss function returns (loss, *new_buffers), or the bare loss without buffers.
            has_buffers = isinstance(values.ty, relax.TupleType)
            loss_out = bb.emit_output(relax.TupleGetItem(values, 0) if has_buffers else values)
            new_buffers = [bb.emit_output(relax.TupleGetItem(values, 1 + i))
                           for i in range(len(buffers))]
            new_shared, factors = optimizer.prepare(bb, shared)
            new_params, new_state = [], {}
            for i, (w, slots) in enumerate(zip(sparams, per_param)):
                g = bb.emit(relax.TupleGetItem(grads, i))
                nw, ns = optimizer.update(bb, w.name, w, g, slots, factors)
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
    inputs = (["x", "y"] + [p.name for p in sparams] + [b.name for b in sbuffers]
              + [v.name for v in state_vars])
    signature = {
        "inputs": inputs,
        "outputs": ["loss"] + [f"new_{n}" for n in inputs[2:]],
        "optimizer_state": state_info,
        "optimizer": {"torch_class": optimizer.torch_class, "kwargs": optimizer.torch_kwargs()},
    }
    return step, signature
