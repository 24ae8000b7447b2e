"""The fused softmax cross-entropy (kernels/softmax_nll.py) on a GPU, written with its threads
bound.

No GPU schedule rule fits that kernel (per-row reductions, then a sum over the rows into one
scalar): the Fallback rule ran all of it on one thread, 75 million serial steps for a language
model's logits (512 x 49152), minutes per step. Here one thread block per row: its threads
stride over the classes for the row's max and sum of exponentials (partial results in shared
memory, combined in order by the first thread), then write the row's gradient; the rows that
are not ignored are counted the same way in every block (the ``mean`` scale needs them). A
second kernel, one thread, adds the rows' losses in order. Deterministic: no atomics.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from pipelines.kernels.softmax_nll import IGNORE_ATTR, LOSS_KERNEL

THREADS = 256


def is_softmax_nll_loss(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and LOSS_KERNEL in func.attrs


def softmax_nll_loss_gpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The GPU kernel for ``func`` (see ``is_softmax_nll_loss``): the same parameters (four
    where the gradient is written over the logits)."""
    rows, classes = (int(d) for d in func.params[0].shape)
    return softmax_nll_loss_kernel(rows, classes, str(func.attrs[LOSS_KERNEL]),
                                   int(func.attrs[IGNORE_ATTR]), len(func.params) == 4)


def softmax_nll_loss_kernel(rows: int, classes: int, reduction: str, ignore_index: int,
                            in_place: bool = False) -> tirx.PrimFunc:
    """The kernel; ``in_place``: without the gradient parameter, the gradient stored over the
    logits (transform/loss_gradient_in_place.py)."""
    mean = reduction == "mean"
    strides = (classes + THREADS - 1) // THREADS
    row_strides = (rows + THREADS - 1) // THREADS
    neg_inf = float("-inf")

    @T.macro
    def combined(part, acc, stat, t, into, sum_not_max):
        # each thread's partial result ``acc`` in shared memory ``part``, then the first thread
        # combines them in thread order (the same result every run) into ``stat[into]``
        part[t] = acc[0]
        T.tvm_storage_sync("shared")
        if t == 0:
            acc[0] = T.if_then_else(sum_not_max, T.float32(0), T.float32(neg_inf))
            for u in T.serial(THREADS):
                acc[0] = T.if_then_else(sum_not_max, acc[0] + part[u], T.max(acc[0], part[u]))
            stat[into] = acc[0]
        T.tvm_storage_sync("shared")

    @T.macro
    def loss_and_gradient(z, y, g, grad, loss):
        row_loss = T.decl_buffer((rows,), "float32")
        for i in T.thread_binding(rows, thread="blockIdx.x"):
            for t in T.thread_binding(THREADS, thread="threadIdx.x"):
                part = T.decl_buffer((THREADS,), "float32", scope="shared")
                stat = T.decl_buffer((3,), "float32", scope="shared")  # max, sum, kept rows
                acc = T.decl_buffer((1,), "float32", scope="local")
                # the rows that score (not ignored, in range)
                acc[0] = T.float32(0)
                for s in T.serial(row_strides):
                    if s * THREADS + t < rows:
                        if (y[s * THREADS + t] != ignore_index and y[s * THREADS + t] >= 0
                                and y[s * THREADS + t] < classes):
                            acc[0] = acc[0] + T.float32(1)
                combined(part, acc, stat, t, 2, True)
                # the row's max
                acc[0] = T.float32(neg_inf)
                for s in T.serial(strides):
                    if s * THREADS + t < classes:
                        acc[0] = T.max(acc[0], z[i, s * THREADS + t])
                combined(part, acc, stat, t, 0, False)
                # the row's sum of exponentials
                acc[0] = T.float32(0)
                for s in T.serial(strides):
                    if s * THREADS + t < classes:
                        acc[0] = acc[0] + T.exp(z[i, s * THREADS + t] - stat[0])
                combined(part, acc, stat, t, 1, True)
                kept: T.let[T.bool] = (y[i] != ignore_index and y[i] >= 0 and y[i] < classes)
                scale: T.let[T.float32] = T.if_then_else(mean, g[()] / stat[2], g[()])
                # the row's loss reads its labelled logit before any thread writes the row's
                # gradient, which may be stored over the logits
                if t == 0:
                    row_loss[i] = T.if_then_else(
                        kept, stat[0] + T.log(stat[1])
                        - z[i, T.Cast("int32", T.if_then_else(kept, y[i], T.int64(0)))],
                        T.float32(0))
                T.tvm_storage_sync("shared")
                # its gradient: (softmax - onehot(label)) * scale, 0 for a row that does not score
                for s in T.serial(strides):
                    if s * THREADS + t < classes:
                        grad[i, s * THREADS + t] = T.if_then_else(
                            kept, T.exp(z[i, s * THREADS + t] - stat[0]) * (scale / stat[1])
                            - T.if_then_else(T.Cast("int64", s * THREADS + t) == y[i], scale,
                                             T.float32(0)), T.float32(0))
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(1, thread="threadIdx.x"):
                total = T.decl_buffer((2,), "float32", scope="local")  # loss sum, kept rows
                total[0] = T.float32(0)
                total[1] = T.float32(0)
                for r in T.serial(rows):
                    total[0] = total[0] + row_loss[r]
                    if y[r] != ignore_index and y[r] >= 0 and y[r] < classes:
                        total[1] = total[1] + T.float32(1)
                loss[()] = T.if_then_else(mean, total[0] / total[1], total[0])

    @T.prim_func(private=True, s_tir=True)
    def softmax_nll_loss(z: T.Buffer((rows, classes), "float32"),
                         y: T.Buffer((rows,), "int64"), g: T.Buffer((), "float32"),
                         grad: T.Buffer((rows, classes), "float32"),
                         loss: T.Buffer((), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        loss_and_gradient(z, y, g, grad, loss)

    @T.prim_func(private=True, s_tir=True)
    def softmax_nll_loss_inplace(z: T.Buffer((rows, classes), "float32"),
                                 y: T.Buffer((rows,), "int64"), g: T.Buffer((), "float32"),
                                 loss: T.Buffer((), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        grad = T.decl_buffer((rows, classes), "float32", data=z.data)
        loss_and_gradient(z, y, g, grad, loss)

    return softmax_nll_loss_inplace if in_place else softmax_nll_loss
