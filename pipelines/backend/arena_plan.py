"""``train_step``'s planned tensors placed in one arena by their lifetimes: a pass right after
TVM's StaticPlanBlockMemory.

StaticPlanBlockMemory gives each planned tensor a storage token, reusing a freed token of about
its size (up to 16 times larger, or growing a smaller one) and never splitting or merging
tokens. A step that frees activations while it keeps others (recomputing cheap ones, say) then
leaves its kept tensors in larger tokens freed earlier, and tokens of one size cannot serve a
later need of another: its storage grows well above what is alive at once. This pass keeps
StaticPlanBlockMemory's decisions about what is planned and replaces its tokens: each planned
tensor lives from its allocation to the last use of anything that may share its storage (a
reshape, an alias, a tuple holding it); the tensors are placed, largest first, at the lowest
offset of one storage where they overlap no tensor alive at the same time (the greedy-by-size
offset planning of TFLite's arena planner). Only the CPU build takes it (backend/build.py):
the GPU pipeline's CUDA graph rewrite lifts storage tokens as they are.

Before::

    s1 = alloc_storage(4.5 MiB); a = alloc_tensor(s1, 0, (2, 9, 256, 256))   # freed soon
    s2 = alloc_storage(1.1 MiB); b = alloc_tensor(s2, 0, (2, 256, 576))      # kept long

After::

    arena = alloc_storage(total)
    a = alloc_tensor(arena, 0, (2, 9, 256, 256)); b = alloc_tensor(arena, 4718592, (2, 256, 576))
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from pipelines.analysis.liveness import uses
from pipelines.ir import op_name

FUNCTION = "train_step"
ALIGNMENT = 64  # bytes: TVM's kAllocAlignment, which its kernels assume of every tensor


def _nbytes(call: relax.Call) -> int:
    shape, dtype = call.args[2].values, tvm.DataType(str(call.args[3].value))
    size = dtype.bits * dtype.lanes // 8
    for dim in shape:
        size *= int(dim)
    return -(-size // ALIGNMENT) * ALIGNMENT


def lifetimes(bindings: list[relax.Binding], results: list[relax.Var]
              ) -> dict[relax.Var, list[int]]:
    """Planned tensor (its alloc_tensor binding's var) -> [first, last] binding index at which
    it or anything that may share its storage is used; ``results`` (what the function returns)
    keep theirs to the end. A value made from a planned tensor may alias it unless it is a fresh
    allocation, so aliasing is over-approximated: a lifetime is never too short."""
    storages = {b.var for b in bindings if op_name(b.value) == "relax.memory.alloc_storage"}
    planned = {b.var for b in bindings if op_name(b.value) == "relax.memory.alloc_tensor"
               and b.value.args[0] in storages}
    roots: dict[relax.Var, set] = {}
    fields: dict[relax.Var, list[set]] = {}  # a tuple's roots, field by field
    span: dict[relax.Var, list[int]] = {}
    for i, b in enumerate(bindings):
        value = b.value
        used = [v for v in uses(value) if v in roots]
        # a tuple's field read alone reads only that field's storage (the loss's, not the
        # logits' a fused loss call also returns)
        read = (fields[value.tuple_value][value.index]
                if isinstance(value, relax.TupleGetItem) and value.tuple_value in fields
                else set().union(*(roots[v] for v in used)))
        for root in read:
            span[root][1] = i
        if b.var in planned:
            roots[b.var], span[b.var] = {b.var}, [i, i]
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in fields:
            roots[b.var] = fields[value.tuple_value][value.index]
        elif used and op_name(value) != "relax.memory.alloc_tensor":
            roots[b.var] = set().union(*(roots[v] for v in used))
        if isinstance(value, relax.Tuple):
            fields[b.var] = [roots.get(f, set()) if isinstance(f, relax.Var)
                             else set().union(*(roots.get(v, set()) for v in uses(f)))
                             for f in value.fields]
    for v in results:
        for root in roots.get(v, ()):
            span[root][1] = len(bindings)
    return span


def place(sizes: dict, spans: dict) -> tuple[dict, int]:
    """Offsets for tensors of ``sizes`` bytes alive over ``spans`` ([first, last]): largest first,
    each at the lowest offset where it overlaps no placed tensor alive at the same time.
    Returns the offsets and the arena's size."""
    placed: list[tuple[int, int, int, int]] = []  # offset, end, first, last
    offsets, total = {}, 0
    for var in sorted(sizes, key=lambda v: (-sizes[v], spans[v][0])):
        first, last = spans[var]
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for start, end in busy:
            if offset + sizes[var] <= start:
                break
            offset = max(offset, end)
        offsets[var] = offset
        placed.append((offset, offset + sizes[var], first, last))
        total = max(total, offset + sizes[var])
    return offsets, total


@tvm.transform.module_pass(opt_level=0, name="ArenaPlan")
def arena_plan(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    if FUNCTION not in [g.name_hint for g in mod.get_global_vars()]:
        return mod
    gvar = mod.get_global_var(FUNCTION)
    func = mod[gvar]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    results = uses(func.body.body)
    spans = lifetimes(bindings, results)
    allocs = {b.var: b.value for b in bindings if b.var in spans}
    if not spans or any(not isinstance(d, IntImm)
                        for value in allocs.values() for d in value.args[2].values):
        return mod  # nothing planned, or a symbolic shape: StaticPlanBlockMemory's tokens stay
    offsets, total = place({v: _nbytes(value) for v, value in allocs.items()}, spans)
    arena = relax.Var("arena", relax.ObjectType())
    storages = {value.args[0] for value in allocs.values()}
    rewritten = [relax.VarBinding(arena, relax.op.memory.alloc_storage(
        relax.ShapeExpr([total]), 0, "global", "uint8"))]
    for b in bindings:
        if b.var in storages:
            continue  # a token the arena replaces
        if b.var in spans and offsets[b.var]:
            # TVM's kernels take tensors at byte offset 0: a view whose data pointer starts at
            # the offset instead (vm.builtin.ensure_zero_offset on a CPU: no copy)
            _, _, shape, dtype, _ = b.value.args
            at = relax.Var(f"{b.var.name}_at", b.var.ty)
            rewritten.append(relax.VarBinding(at, relax.op.memory.alloc_tensor(
                arena, offsets[b.var], shape, dtype, 0)))
            b = relax.VarBinding(b.var, relax.op.memory.ensure_zero_offset(at))
        elif b.var in spans:
            _, _, shape, dtype, _ = b.value.args
            b = relax.VarBinding(b.var, relax.op.memory.alloc_tensor(arena, 0, shape, dtype, 0))
        rewritten.append(b)
    body = relax.SeqExpr([relax.BindingBlock(rewritten)], func.body.body)
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[gvar] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs,
                               func.span)
    return mod
