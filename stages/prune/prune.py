"""Sparse backpropagation: layer-level by dead-code elimination, channel-level by slicing.

The full step updates every parameter. Dropping the outputs of frozen parameters (their new
values and optimizer state) makes their gradients dead, and with them every backward op that
only fed those gradients, including all backward work through a frozen prefix of the network.
Parameters a scheme updates on some channels only are then rewritten by
stages/prune/channels.py to compute and apply just that slice of their gradient.
"""
from __future__ import annotations

import tvm
from tvm import relax

from stages.prune.channels import slice_updates


def prune_step(step: relax.Function, signature: dict, trainable: set[str]) -> tuple:
    """Keep only the updates of ``trainable`` (Relax parameter names); return the pruned step
    and its signature. The full step (stages/autodiff/training.py) takes
    (x, y, *params, *buffers, *optimizer_state) and returns the loss and ``new_<input>`` for
    every state input; a frozen parameter keeps its input but loses its new value and its
    optimizer state."""
    P, inputs, outputs = signature["num_params"], signature["inputs"], signature["outputs"]
    params = inputs[2:2 + P]
    state_info = signature["optimizer_state"]
    frozen = {p for p in params if p not in trainable}
    frozen_state = {n for n, info in state_info.items() if info["param"] in frozen}
    keep_in = [i for i, name in enumerate(inputs) if name not in frozen_state]
    keep_out = [i for i, name in enumerate(outputs)
                if name.removeprefix("new_") not in frozen | frozen_state]
    body = step.body
    narrowed = relax.Function(step.params, relax.BlockBuilder().normalize(relax.SeqExpr(
        body.blocks, relax.Tuple([body.body.fields[i] for i in keep_out]))))
    pruned = relax.transform.DeadCodeElimination(["train_step"])(
        tvm.IRModule({"train_step": narrowed.with_attr("global_symbol", "train_step")})
    )["train_step"]
    # The optimizer state of frozen parameters is now unused: drop it from the inputs too.
    still_read = set(relax.analysis.free_vars(pruned.body))
    dropped = [p for i, p in enumerate(pruned.params) if i not in keep_in]
    assert not still_read & set(dropped), "pruned step still reads a frozen parameter's state"
    pruned = relax.Function([pruned.params[i] for i in keep_in], pruned.body)
    new_signature = dict(signature,
                         inputs=[inputs[i] for i in keep_in],
                         outputs=[outputs[i] for i in keep_out],
                         optimizer_state={n: info for n, info in state_info.items()
                                          if n not in frozen_state},
                         trainable=[p for p in params if p in trainable])
    return pruned.with_attr("global_symbol", "train_step"), new_signature


def sparse_step(step: relax.Function, signature: dict,
                selection: dict[str, dict | None]) -> tuple[relax.Function, dict, dict]:
    """The full ``step`` restricted to a scheme's ``selection`` (stages/prune/scheme.py: PyTorch
    name -> None or channels). Returns the step, its signature and, per channel-sparse
    parameter, how its gradient slice is computed (stages/prune/channels.py)."""
    relax_of = {torch: relax for relax, torch in signature["torch_names"].items()}
    pruned, pruned_signature = prune_step(step, signature, {relax_of[n] for n in selection})
    return slice_updates(pruned, pruned_signature,
                         {relax_of[n]: s for n, s in selection.items() if s is not None})
