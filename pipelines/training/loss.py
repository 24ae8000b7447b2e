"""The loss a training step appends to the model's output, by the model's task (Model.task):

    classification   output [batch, classes], labels [batch] int64: cross-entropy
    causal_lm        output [batch, seq, vocab], labels [batch, seq] int64: each position
                     predicts the next token's label (the labels shifted left by one, as
                     transformers' ForCausalLMLoss does), cross-entropy over the positions
    masked_lm        output [batch, seq, vocab], labels [batch, seq] int64: cross-entropy at
                     each position, unshifted
    regression       output any float shape, labels the same shape float32: mean squared error

Labels equal to IGNORE_INDEX (-100, PyTorch's and transformers' convention) score nothing; the
mean is over the labels that score. PyTorch's side of the same losses: models/pytorch.py.

Each loss is a Relax function ``(output, labels) -> loss`` for relax.training.AppendLoss. The
token losses shift the integer labels, never the output: the output is reshaped to one row per
position, and the position with no next token gets the label IGNORE_INDEX, so the gradient
flows through reshape and the softmax cross-entropy alone (which transform/
fuse_softmax_cross_entropy.py makes one kernel).
"""
from __future__ import annotations

import math

from tvm import relax
from tvm.relax.training.loss import CrossEntropyLoss

from pipelines.schema import ConfigError
from pipelines.tasks import IGNORE_INDEX, TASKS
from pipelines.ir import dtype_of, shape_of, tensor_type

SHAPES = {"classification": "[batch, classes]", "causal_lm": "[batch, seq, vocab]",
          "masked_lm": "[batch, seq, vocab]", "regression": "any float shape"}


def loss_function(task: str, output: relax.TensorType) -> tuple[relax.Function, relax.TensorType]:
    """(the loss function, the labels' type) for ``task`` on a model output of type ``output``.
    A task the output's shape does not fit is a ConfigError naming both."""
    shape, dtype = shape_of(output), dtype_of(output)
    if task not in TASKS:
        raise ConfigError(f"task {task!r}; allowed: {list(TASKS)}")
    rank = {"classification": 2, "causal_lm": 3, "masked_lm": 3}.get(task)
    if "float" not in dtype or (rank is not None and len(shape) != rank):
        raise ConfigError(
            f"the model's output is {dtype} of shape {list(shape)}, but task {task!r} takes "
            f"{SHAPES[task]} float logits; allowed tasks by output: "
            + "; ".join(f"{t}: {s}" for t, s in SHAPES.items()))
    if task == "classification":
        labels = tensor_type([shape[0]], "int64")
        return CrossEntropyLoss(reduction="mean", ignore_index=IGNORE_INDEX)(output, labels), labels
    if task == "regression":
        return _mean_squared_error(output), output
    labels = tensor_type(shape[:2], "int64")
    return _token_cross_entropy(output, shifted=task == "causal_lm"), labels


def _token_cross_entropy(output: relax.TensorType, shifted: bool) -> relax.Function:
    batch, seq, vocab = shape_of(output)
    logits = relax.Var("predictions", output)
    labels = relax.Var("targets", tensor_type([batch, seq], "int64"))
    bb = relax.BlockBuilder()
    with bb.function("token_cross_entropy", [logits, labels]):
        with bb.dataflow():
            target = labels
            if shifted:  # position t scores label t+1; the last position scores nothing
                nothing = bb.emit(relax.op.full([batch, 1], relax.const(IGNORE_INDEX, "int64"),
                                                "int64"))
                later = bb.emit(relax.op.strided_slice(labels, [1], [1], [seq]))
                target = bb.emit(relax.op.concat([later, nothing], axis=1))
            rows = bb.emit(relax.op.reshape(logits, [batch * seq, vocab]))
            flat = bb.emit(relax.op.reshape(target, [batch * seq]))
            log_p = bb.emit(relax.op.nn.log_softmax(rows))
            loss = bb.emit_output(relax.op.nn.nll_loss(log_p, flat, None, "mean", IGNORE_INDEX))
        bb.emit_func_output(loss)
    return bb.get()["token_cross_entropy"]


def _mean_squared_error(output: relax.TensorType) -> relax.Function:
    prediction, target = relax.Var("predictions", output), relax.Var("targets", output)
    bb = relax.BlockBuilder()
    with bb.function("mean_squared_error", [prediction, target]):
        with bb.dataflow():
            error = bb.emit(relax.op.subtract(prediction, target))
            total = bb.emit(relax.op.sum(relax.op.multiply(error, error)))
            count = relax.const(float(math.prod(shape_of(output))), dtype_of(output))
            loss = bb.emit_output(relax.op.divide(total, count))
        bb.emit_func_output(loss)
    return bb.get()["mean_squared_error"]
