"""Sparse layer backpropagation by dead-code elimination.

The full step updates every parameter. Dropping the outputs of frozen parameters (their new
values and momenta) makes their gradients dead, and with them every backward op that only fed
those gradients, including all backward work through a frozen prefix of the network.
"""
from __future__ import annotations

import tvm
from tvm import relax


def prune_step(step: relax.Function, signature: dict, trainable: set[str]) -> tuple:
    """Keep only the updates of ``trainable`` (Relax parameter names); return the pruned step
    and its signature. The full step's layout (stages/autodiff/training.py) is
    inputs  (x, y, *params, *buffers, *momenta)  and
    outputs (loss, *new_params, *new_momenta, *new_buffers)."""
    P, inputs, outputs = signature["num_params"], signature["inputs"], signature["outputs"]
    B = len(inputs) - 2 - 2 * P
    kept = [i for i, name in enumerate(inputs[2:2 + P]) if name in trainable]
    keep_in = list(range(2 + P + B)) + [2 + P + B + i for i in kept]
    keep_out = [0] + [1 + i for i in kept] + [1 + P + i for i in kept] + \
        list(range(1 + 2 * P, 1 + 2 * P + B))
    body = step.body
    narrowed = relax.Function(step.params, relax.BlockBuilder().normalize(relax.SeqExpr(
        body.blocks, relax.Tuple([body.body.fields[i] for i in keep_out]))))
    pruned = relax.transform.DeadCodeElimination(["train_step"])(
        tvm.IRModule({"train_step": narrowed.with_attr("global_symbol", "train_step")})
    )["train_step"]
    # Momenta of frozen parameters are now unused: drop them from the signature too.
    still_read = set(relax.analysis.free_vars(pruned.body))
    dropped = [p for i, p in enumerate(pruned.params) if i not in keep_in]
    assert not still_read & set(dropped), "pruned step still reads a dropped momentum"
    pruned = relax.Function([pruned.params[i] for i in keep_in], pruned.body)
    new_signature = dict(signature,
                         inputs=[inputs[i] for i in keep_in],
                         outputs=[outputs[i] for i in keep_out],
                         trainable=[inputs[2 + i] for i in kept])
    return pruned.with_attr("global_symbol", "train_step"), new_signature
