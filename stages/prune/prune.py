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
    and its signature."""
    P, inputs, outputs = signature["num_params"], signature["inputs"], signature["outputs"]
    params = inputs[2:2 + P]
    keep_in = [i for i, name in enumerate(inputs)
               if not name.startswith("m_") or name[2:] in trainable]
    keep_out = [i for i, name in enumerate(outputs)
                if not name.startswith(("new_p_", "new_m_"))
                or name.removeprefix("new_").removeprefix("m_") in trainable]
    body = step.body
    fields = body.body.fields
    bb = relax.BlockBuilder()
    narrowed = relax.Function(step.params, bb.normalize(relax.SeqExpr(
        body.blocks, relax.Tuple([fields[i] for i in keep_out]))))
    narrowed = narrowed.with_attr("global_symbol", "train_step")
    pruned = relax.transform.DeadCodeElimination(["train_step"])(
        tvm.IRModule({"train_step": narrowed}))["train_step"]
    # Momenta of frozen parameters are now unused: drop them from the signature too.
    used = set(relax.analysis.free_vars(pruned.body))
    dropped = [pruned.params[i].name for i in range(len(inputs)) if i not in keep_in]
    assert not any(pruned.params[i] in used for i in range(len(inputs)) if i not in keep_in), \
        f"pruned step still reads {dropped}"
    pruned = relax.Function([pruned.params[i] for i in keep_in], pruned.body)
    pruned = pruned.with_attr("global_symbol", "train_step")
    new_signature = dict(signature,
                         inputs=[inputs[i] for i in keep_in],
                         outputs=[outputs[i] for i in keep_out],
                         trainable=[p for p in params if p in trainable])
    return pruned, new_signature
