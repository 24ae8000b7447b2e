"""What each binding of the training step is, and what is alive when: the analyses that update
reordering, recomputation, the memory plan and the cost report read.

The step is one dataflow block. Bindings are classified by structure, not by name:
- update:   consumed only by the new value (and optimizer state) of one parameter: its weight
            gradient, the optimizer arithmetic and whatever feeds only them;
- forward:  what the loss or the new buffers (batch-norm running statistics) are computed from,
            without the labels: the forward pass;
- backward: the rest: everything after the loss, and work the backward pass does on its own
            (e.g. recomputing an activation, pipelines/transform/recompute.py).
"""
from __future__ import annotations

from collections import defaultdict

from tvm import relax

from pipelines.ir import nbytes


def block_of(func: relax.Function) -> relax.DataflowBlock:
    blocks = func.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise ValueError("expected the training step as a single dataflow block")
    return blocks[0]


def uses(expr) -> list[relax.Var]:
    found = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e)
                                    if isinstance(e, relax.Var) else None)
    return found


def readers(bindings) -> dict[relax.Var, list[relax.Var]]:
    """Var -> the binding vars whose values read it (empty for a var nothing reads)."""
    found = defaultdict(list)
    for b in bindings:
        for used in uses(b.value):
            found[used].append(b.var)
    return found


def dependencies(func: relax.Function) -> dict[relax.Var, list[relax.Var]]:
    """Binding var -> the binding vars its value reads."""
    bindings = block_of(func).bindings
    defined = {b.var for b in bindings}
    return {b.var: [v for v in uses(b.value) if v in defined] for b in bindings}


LABELS = "labels"  # the step's labels input (training/graph.py)


def needs_labels(func: relax.Function, deps: dict) -> set[relax.Var]:
    """Bindings that depend on the labels: the loss and everything derived from it."""
    labels, found = next(p for p in func.params if p.name == LABELS), set()
    for b in block_of(func).bindings:
        if labels in uses(b.value) or any(d in found for d in deps[b.var]):
            found.add(b.var)
    return found


def classify(func: relax.Function, update_outputs: dict[int, str]) -> dict[relax.Var, str]:
    """Class of every binding var. ``update_outputs`` maps the output-tuple indices that hold a
    new parameter or optimizer state to the parameter they belong to."""
    bindings = block_of(func).bindings
    deps = dependencies(func)
    consumers: dict[relax.Var, list] = {b.var: [] for b in bindings}
    for var, used in deps.items():
        for u in used:
            consumers[u].append(var)
    outputs = list(func.body.body.fields)
    # Which parameters' updates each binding feeds; None marks feeding anything else.
    feeds: dict[relax.Var, set] = {}
    for i, v in enumerate(outputs):
        feeds.setdefault(v, set()).add(update_outputs.get(i))
    for b in reversed(bindings):  # consumers come after their producers
        mine = feeds.setdefault(b.var, set())
        for c in consumers[b.var]:
            mine |= feeds[c]
    after_loss = needs_labels(func, deps)
    # The forward pass: the loss's and the new buffers' ancestors (outputs that are no update).
    forward = {v for i, v in enumerate(outputs) if i not in update_outputs}
    for b in reversed(bindings):
        if b.var in forward:
            forward |= set(deps[b.var])

    def kind(v):
        if len(feeds[v]) == 1 and None not in feeds[v]:
            return "update"
        return "forward" if v in forward and v not in after_loss else "backward"

    return {b.var: kind(b.var) for b in bindings}


def saved_for_backward(func: relax.Function, update_outputs: dict[int, str]) -> int:
    """Bytes of forward values the backward pass or an update reads: the activations a
    training step must keep from its forward pass."""
    kinds = classify(func, update_outputs)
    read_later = {v for b in block_of(func).bindings if kinds[b.var] != "forward"
                  for v in uses(b.value)}
    return sum(nbytes(b.var) for b in block_of(func).bindings
               if kinds[b.var] == "forward" and b.var in read_later
               and isinstance(b.var.ty, relax.TensorType))


def in_place_results(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """Binding vars that are an input's own storage, written in place (``call_tir_inplace``,
    transform/update_in_place.py, loss_gradient_in_place.py) -> that input."""
    found, tuples = {}, {}
    for b in block_of(func).bindings:
        value = b.value
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == \
                "relax.call_tir_inplace":
            args = list(value.args[1].fields)
            indices = [int(i) for i in value.attrs.inplace_indices]
            if isinstance(value.ty, relax.TupleType):
                tuples[b.var] = [args[j] if j >= 0 else None for j in indices]
            elif indices[0] >= 0:
                found[b.var] = args[indices[0]]
        elif isinstance(value, relax.TupleGetItem) and value.tuple_value in tuples:
            if tuples[value.tuple_value][value.index] is not None:
                found[b.var] = tuples[value.tuple_value][value.index]
    return found


def liveness(func: relax.Function, update_outputs: dict[int, str]) -> dict:
    """Bytes alive at the step's peak, walking its bindings in order: a binding's tensor lives
    from its definition to its last use (outputs to the end); one written in an input's storage
    takes none, or takes over that storage where the step made it. Broken down by class; the
    step's inputs are counted by the caller. This ignores allocator fragmentation, which TVM's
    static planner (planned_storage_bytes) does not."""
    block = block_of(func)
    kinds = classify(func, update_outputs)
    outputs = set(func.body.body.fields)
    in_place = in_place_results(func)
    last_use = {}
    for i, b in enumerate(block.bindings):
        for v in uses(b.value):
            last_use[v] = i
    live: dict[relax.Var, tuple[str, int]] = {}
    peak, at_peak = -1, {}
    for i, b in enumerate(block.bindings):
        source = in_place.get(b.var)
        if isinstance(b.var.ty, relax.TensorType) and (source is None or source in live):
            kind = "outputs" if b.var in outputs else kinds[b.var]
            live.pop(source, None)  # a step's own tensor written in place: its storage moves
            live[b.var] = (kind, nbytes(b.var))
        total = sum(size for _, size in live.values())
        if total > peak:
            peak, at_peak = total, dict(live)
        for v in [v for v in live if v not in outputs and last_use.get(v, -1) <= i]:
            del live[v]
    breakdown = {"activations_for_backward": 0, "backward_workspace": 0,
                 "gradients_and_updates": 0, "outputs": 0}
    names = {"forward": "activations_for_backward", "backward": "backward_workspace",
             "update": "gradients_and_updates", "outputs": "outputs"}
    for kind, size in at_peak.values():
        breakdown[names[kind]] += size
    return {"peak_live_bytes": peak, "at_peak": breakdown}


def update_owners(signature: dict) -> dict[int, str]:
    """Output index -> parameter, for the outputs that hold a new parameter or optimizer state
    (the optimizer's shared step count belongs to "optimizer")."""
    owner = {p: p for p in signature["trainable"]}
    owner |= {n: info["param"] or "optimizer" for n, info in signature["optimizer_state"].items()}
    return {i: owner[name.removeprefix("new_")] for i, name in enumerate(signature["outputs"])
            if name.removeprefix("new_") in owner}


def update_kernels(optimized) -> list[str]:
    """Names of the kernels whose results the optimized step returns as new state (the updates;
    where the optimize phase fused a weight gradient into its update, that kernel counts
    here)."""
    func = optimized["train_step"]
    returned = list(func.body.body.fields[1:])  # after the loss; by identity (names repeat)
    return sorted({binding.value.args[0].name_hint
                   for block in func.body.blocks for binding in block.bindings
                   if isinstance(binding.value, relax.Call)
                   and getattr(binding.value.op, "name", "") in ("relax.call_tir",
                                                                  "relax.call_tir_inplace")
                   and any(binding.var.same_as(var) for var in returned)})
