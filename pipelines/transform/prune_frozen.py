"""new_w of a frozen parameter w (and its optimizer state) -> gone, with every op only they needed.

Sparse layer backpropagation: the full step (training/graph.py) returns the loss and
``new_<input>`` for every state input. Dropping the outputs of the parameters a scheme freezes
(their new values and optimizer state) makes their gradients dead, and dead-code elimination
removes every backward op that only fed them, including all backward work through a frozen
prefix of the network. A frozen parameter stays an input (the forward reads it); its optimizer
state leaves the inputs. The signature follows (``trainable``). Run on the full step, before
channel slicing (slice_channels.py).

Before (w1 frozen, w2 trained)::

    def train_step(x, labels, w1, w2, m_w1, m_w2):
        h = matmul(x, w1); logits = matmul(h, w2); loss = ...
        dh = ...; dw1 = matmul(x^T, dh); dw2 = matmul(h^T, dlogits)
        new_m_w1 = 0.9 * m_w1 + dw1; new_w1 = w1 - lr * new_m_w1
        new_m_w2 = 0.9 * m_w2 + dw2; new_w2 = w2 - lr * new_m_w2
        return loss, new_w1, new_w2, new_m_w1, new_m_w2

After::

    def train_step(x, labels, w1, w2, m_w2):
        h = matmul(x, w1); logits = matmul(h, w2); loss = ...
        dw2 = matmul(h^T, dlogits)                      # dh, dw1: gone
        new_m_w2 = 0.9 * m_w2 + dw2; new_w2 = w2 - lr * new_m_w2
        return loss, new_w2, new_m_w2
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.ir import signature_of, with_signature


def _pruned(step: relax.Function, signature: dict, trainable: set[str]) -> tuple:
    """Keep only the updates of ``trainable`` (Relax parameter names); the pruned step and its
    signature."""
    data, inputs, outputs = len(signature["data"]), signature["inputs"], signature["outputs"]
    params = inputs[data:data + signature["num_params"]]
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


@tvm.transform.module_pass(opt_level=0, name="PruneFrozenUpdates")
class PruneFrozenUpdates:
    """``train_step`` restricted to the updates of ``trainable`` (Relax parameter names)."""

    def __init__(self, trainable):
        self.trainable = set(trainable)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        step, signature = _pruned(mod["train_step"], signature_of(mod), self.trainable)
        out = mod.clone()
        out["train_step"] = step
        return with_signature(out, signature)
