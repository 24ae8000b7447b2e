"""update(w, dw) at the end of the step -> right after dw exists (the paper's operator reordering).

The autodiff stage emits every parameter's update after the whole backward pass, so every
weight gradient stays alive until the end. This moves each parameter's gradient-and-update work
to right after its inputs exist: a gradient buffer dies as soon as its update has consumed it.
The order changes, the computation does not (analysis/liveness.py classifies the bindings).

Before::

    dh2 = ...; dw2 = matmul(h1^T, dh2)        # backward through layer 2
    dh1 = ...; dw1 = matmul(x^T, dh1)         # backward through layer 1
    new_w2 = w2 - lr * dw2                    # every update at the end:
    new_w1 = w1 - lr * dw1                    # dw2 alive across layer 1's backward

After::

    dh2 = ...; dw2 = matmul(h1^T, dh2)
    new_w2 = w2 - lr * dw2                    # dw2 dies here
    dh1 = ...; dw1 = matmul(x^T, dh1)
    new_w1 = w1 - lr * dw1
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import (block_of, classify, dependencies, needs_labels,
                                         update_owners)
from pipelines.ir import signature_of


def _reordered(func: relax.Function, update_outputs: dict[int, str]) -> relax.Function:
    """The same step with each update scheduled as early as its gradient allows.

    Update bindings that need the labels (gradients and everything after them) run as soon as
    their inputs exist; update bindings that do not (e.g. weight decay's ``wd * w``) run just
    before their first consumer instead of from the start of the step."""
    block = block_of(func)
    kinds = classify(func, update_outputs)
    by_var = {b.var: b for b in block.bindings}
    deps = dependencies(func)
    labelled = needs_labels(func, deps)
    eager = [b.var for b in block.bindings if kinds[b.var] == "update" and b.var in labelled]
    order, done = [], set()

    def emit(var):  # emit var after whatever it still waits for (lazy producers included)
        if var in done:
            return
        for d in deps[var]:
            emit(d)
        done.add(var)
        order.append(by_var[var])

    # what an eager update waits for: its inputs, but for the lazy ones (emitted with it)
    waits_for = {var: [d for d in deps[var] if kinds[d] != "update" or d in labelled]
                 for var in eager}

    def ready(var):
        return all(d in done for d in waits_for[var])

    pending = list(eager)
    for b in block.bindings:
        if kinds[b.var] == "update":
            continue
        emit(b.var)
        progress = True
        while progress:  # emitting one update can make the next one ready
            progress = False
            for var in list(pending):
                if var in done:
                    pending.remove(var)
                elif ready(var):
                    emit(var)
                    pending.remove(var)
                    progress = True
    for b in block.bindings:  # what nothing pulled, e.g. Adam's new step count
        emit(b.var)
    assert len(order) == len(block.bindings)
    body = relax.SeqExpr([relax.DataflowBlock(order)], func.body.body)
    return relax.Function(func.params, body, func.body.body.ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="ReorderUpdates")
class ReorderUpdates:
    """``train_step`` with each update scheduled as early as its gradient allows."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod.clone()
        out["train_step"] = _reordered(mod["train_step"], update_owners(signature_of(mod)))
        return out
