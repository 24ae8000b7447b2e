"""new_w = update(w, dw) -> the update written into w's own storage (weights, optimizer state and
batch-norm statistics updated in place).

After fusion, each new value the step returns for an entry of its state (a parameter, an
optimizer buffer, a running statistic) comes from one kernel that reads the old value. The step
used to return it in fresh storage, so at its end it held the model and its optimizer state
twice. Where that kernel reads each element of the old value only before, or where, it writes
the same element of the new value, its call becomes ``call_tir_inplace``: the kernel writes
into the old value's buffer and the step returns the caller's own tensor. The kernel keeps a
buffer of its own for what it writes, declared over the old value's data. An optimizer update
moves after every other reader of the old value (a linear layer's input gradient reads its
weight after the weight's gradient exists); a forward kernel that writes running statistics is
made in place only where it is their last reader already.

Before::

    new_w = R.call_tir(update, (dw, w), out_ty=R.Tensor((n, k)))    # fresh storage
After::

    new_w = R.call_tir_inplace(update_inplace, (dw, w), inplace_indices=[1], ...)   # w's

The caller's state tensors change under it: a caller that needs the state before a step copies
it first (runtime/step.py). A kernel where an element could be read after it was overwritten
(a reduction writing the new value, a later block reading the old one, indices that differ)
keeps its fresh output.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir.schedule.schedule import ScheduleError

from pipelines.analysis.liveness import block_of, classify, update_owners, uses
from pipelines.ir import signature_of, with_attrs_of, with_signature

SPATIAL = 0  # tirx.IterVar iter_type


def _regions(regions, buffer) -> list:
    return [r.region for r in regions if r.source.same_as(buffer)]


def _elementwise_region(block: tirx.Stmt, region) -> bool:
    """Whether ``region`` is one element at the block's own (spatial) iteration: each instance of
    the block touches its own element."""
    axes = [iv.var for iv in block.iter_vars]
    return (len(region) == len(axes) and all(iv.iter_type == SPATIAL for iv in block.iter_vars)
            and all(r.min.same_as(v) and int(r.extent) == 1 for r, v in zip(region, axes)))


def writes_safely_over(kernel: tirx.PrimFunc, source, target) -> bool:
    """Whether ``kernel`` computes the same when its output ``target`` is stored in its input
    ``source``'s buffer: one block writes ``target``, element by element at its own iteration,
    reading ``source`` only at that element; no later block reads ``source``; none writes it."""
    if [int(d) for d in source.shape] != [int(d) for d in target.shape] or (
            source.dtype != target.dtype):
        return False
    try:
        sch = s_tir.Schedule(kernel)
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except ScheduleError:  # no root block: a hand-written kernel, left as it is
        return False
    if any(sch.get_child_blocks(sch.get_sblock(b.name_hint)) for b in blocks):
        return False  # nested blocks: not a legalized, fused kernel
    writers = [i for i, b in enumerate(blocks) if _regions(b.writes, target)]
    if len(writers) != 1 or any(_regions(b.writes, source) for b in blocks):
        return False
    w = blocks[writers[0]]
    (written,) = _regions(w.writes, target) or [None]
    if written is None or not _elementwise_region(w, written):
        return False
    same_element = all(len(r) == len(written) and all(
        a.min.same_as(b.min) and int(a.extent) == 1 for a, b in zip(r, written))
        for r in _regions(w.reads, source))
    read_later = any(_regions(b.reads, source) for b in blocks[writers[0] + 1:])
    return same_element and not read_later


def written_over(kernel: tirx.PrimFunc, sources: dict) -> tirx.PrimFunc:
    """``kernel`` without the output parameters that are keys of ``sources``: each becomes a
    buffer declared over its source parameter's data. The blocks still read the source and
    write a buffer of their own, which TVM's schedules ask of a block (a block that read and
    wrote one buffer would be left unvectorised on the CPU and unbound on a GPU)."""
    aliases = {out: tirx.decl_buffer(out.shape, out.dtype, out.name) for out in sources}

    def swap(var):
        return next((alias for out, alias in aliases.items() if var.same_as(out)), var)

    realize = tvm_ffi.structural_map(kernel.body, [(tvm.ir.expr.Var, swap)], order="pre")
    root = realize.block
    body = list(root.body) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    declared = [tirx.DeclBuffer(aliases[out], data=source.data)
                for out, source in sources.items()]
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt([*declared, *body]), root.init, root.alloc_buffers,
                        root.match_buffers, root.annotations)
    params = [p for p in kernel.params if not any(p.same_as(out) for out in sources)]
    return tirx.PrimFunc(params, s_tir.SBlockRealize(realize.iter_values, realize.predicate,
                                                     root), kernel.ret_type, kernel.attrs)


def _returned_state(func: relax.Function, signature: dict) -> dict:
    """The state input each returned value replaces, by the returned var."""
    by_name = dict(zip(signature["inputs"], func.params))
    return {var: by_name[name.removeprefix("new_")]
            for var, name in zip(func.body.body.fields, signature["outputs"])
            if name.startswith("new_") and name.removeprefix("new_") in by_name}


def _candidates(mod: tvm.IRModule, block, replaces: dict, live_out: set) -> dict:
    """Binding var -> {output index: argument index} of the kernel calls whose outputs can
    take their state argument's storage (whatever else still reads that state)."""
    elements: dict[relax.Var, dict[int, relax.Var]] = {}  # a tuple result's returned elements
    for b in block.bindings:
        if isinstance(b.value, relax.TupleGetItem) and b.var in replaces:
            elements.setdefault(b.value.tuple_value, {})[b.value.index] = replaces[b.var]
    found = {}
    for b in block.bindings:
        call = b.value
        if not (isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.call_tir"
                and len(call.args) == 2):  # a third argument: symbolic shapes, not in a step
            continue
        args = list(call.args[1].fields)
        wanted = (elements.get(b.var, {}) if isinstance(call.ty, relax.TupleType)
                  else {0: replaces[b.var]} if b.var in replaces else {})
        kernel = mod[call.args[0]]
        outputs, chosen = kernel.params[len(args):], {}
        for k, state in sorted(wanted.items()):
            positions = [j for j, a in enumerate(args) if a.same_as(state)]
            if (len(positions) == 1 and state not in live_out
                    and positions[0] not in chosen.values()
                    and writes_safely_over(kernel, kernel.params[positions[0]], outputs[k])):
                chosen[k] = positions[0]
        if chosen:
            found[b.var] = chosen
    return found


def _reshapes(kernel: tirx.PrimFunc) -> bool:
    """Whether ``kernel`` only reshapes once its intermediate blocks are inlined, as the CPU
    schedules inline them (two ``expand_dims`` fused are two blocks until then)."""
    try:
        sch = s_tir.Schedule(kernel)
        for block in sch.get_child_blocks(sch.get_sblock("root"))[:-1]:
            sch.compute_inline(block)
    except ScheduleError:
        return relax.analysis.has_reshape_pattern(kernel)
    return relax.analysis.has_reshape_pattern(sch.mod["main"])


def storage_views(mod: tvm.IRModule, block) -> dict:
    """Binding var -> the variables whose storage it may share: the build turns a kernel that
    only reshapes (an ``expand_dims`` of a layer scale) into a view of its input
    (RewriteDataflowReshape), so what reads the view reads the state after it was updated."""
    views: dict = {}
    for b in block.bindings:
        call = b.value
        if not isinstance(call, relax.Call):
            continue
        name = getattr(call.op, "name", "")
        # a reshape reads one tensor (TVM's rewrite takes no other): only those are scheduled
        if (name == "relax.call_tir" and len(call.args[1].fields) == 1
                and _reshapes(mod[call.args[0]])):
            sources = [a for a in call.args[1].fields if isinstance(a, relax.Var)]
        elif name == "relax.reshape":
            sources = [call.args[0]]
        else:
            continue
        views[b.var] = {root for v in sources for root in views.get(v, {v})}
    return views


def _readers(block, used: dict) -> dict:
    """Each variable -> the bindings that read it (``used``: binding var -> what it reads)."""
    readers: dict = {}
    for b in block.bindings:
        for v in set(used[b.var]):
            readers.setdefault(v, []).append(b.var)
    return readers


def _after_other_readers(block, candidates: dict, used: dict) -> list:
    """The bindings in their order, except that each candidate comes after every other reader of
    the state it overwrites (a candidate that cannot, without a cycle, drops out of
    ``candidates``). ``used``: binding var -> the variables its value reads."""
    bindings = list(block.bindings)
    defined = {b.var for b in bindings}
    deps = {b.var: {v for v in used[b.var] if v in defined} for b in bindings}
    by_var = {b.var: b for b in bindings}
    read_by = _readers(block, used)
    readers = {var: {r for j in chosen.values()
                     for r in read_by.get(by_var[var].value.args[1].fields[j], [])
                     if not r.same_as(var)}
               for var, chosen in candidates.items()}
    order, done, pending = [], set(), []
    for b in bindings:
        pending.append(b)
        while True:
            ready = next((p for p in pending if deps[p.var] <= done
                          and readers.get(p.var, set()) <= done), None)
            if ready is None:
                break
            pending.remove(ready)
            order.append(ready)
            done.add(ready.var)
    while pending:  # a cycle through a candidate: the first one waiting keeps fresh storage
        stuck = next(p for p in pending if p.var in readers)
        readers.pop(stuck.var), candidates.pop(stuck.var)
        while (ready := next((p for p in pending if deps[p.var] <= done
                              and readers.get(p.var, set()) <= done), None)) is not None:
            pending.remove(ready)
            order.append(ready)
            done.add(ready.var)
    return order


def _in_place(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    """``mod`` with its state updated in place where that computes the same; the state inputs
    so updated."""
    signature = signature_of(mod)
    func = mod["train_step"]
    block = block_of(func)
    replaces = _returned_state(func, signature)
    live_out = {v for v in func.body.body.fields if isinstance(v, relax.Var)}
    candidates = _candidates(mod, block, replaces, live_out)
    # Only an optimizer update waits for the old value's other readers. A forward kernel that
    # also writes new running statistics (batch norm) would take the forward pass after it
    # along (a recomputed batch norm reads them again in the backward pass): it keeps fresh
    # storage for them unless it is their last reader already.
    kinds = classify(func, update_owners(signature))
    position = {b.var: i for i, b in enumerate(block.bindings)}
    views = storage_views(mod, block)  # a view's reader reads what it views
    used = {b.var: [*(read := uses(b.value)), *(s for v in read for s in views.get(v, ()))]
            for b in block.bindings}
    read_by = _readers(block, used)
    for var in [v for v in candidates if kinds[v] != "update"]:
        states = [block.bindings[position[var]].value.args[1].fields[j]
                  for j in candidates[var].values()]
        if any(position[r] > position[var] for s in states for r in read_by.get(s, [])):
            del candidates[var]
    ordered = _after_other_readers(block, candidates, used)
    builder, updated, bindings, made = relax.BlockBuilder(mod.clone()), [], [], {}
    for b in ordered:
        if b.var not in candidates:
            bindings.append(b)
            continue
        call, chosen = b.value, candidates[b.var]
        kernel = mod[call.args[0]]
        args = list(call.args[1].fields)
        outputs = kernel.params[len(args):]
        indices = [chosen.get(k, -1) for k in range(len(outputs))]
        key = (call.args[0].name_hint, tuple(indices))
        if key not in made:  # one in-place kernel per kernel and choice of buffers
            made[key] = builder.add_func(
                written_over(kernel, {outputs[k]: kernel.params[j] for k, j in chosen.items()}),
                f"{key[0]}_inplace")
        tuple_out = isinstance(call.ty, relax.TupleType)
        bindings.append(relax.VarBinding(b.var, relax.call_tir_inplace(
            made[key], call.args[1], indices if tuple_out else indices[0],
            list(call.ty.fields) if tuple_out else call.ty)))
        updated.extend(args[j].name for j in chosen.values())
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], func.body.body)
    builder.update_func(mod.get_global_var("train_step"), relax.Function(
        func.params, body, func.body.body.ty, func.is_pure, func.attrs))
    out = relax.transform.DeadCodeElimination(["train_step"])(with_attrs_of(mod, builder.get()))
    return with_signature(out, dict(signature, updated_in_place=sorted(updated))), updated


@tvm.transform.module_pass(opt_level=0, name="UpdateInPlace")
class UpdateInPlace:
    """``train_step`` (optimized and fused) with its state updated in its own storage wherever
    that computes the same."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _in_place(mod)[0]
