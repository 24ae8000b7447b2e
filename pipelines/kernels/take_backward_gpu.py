"""The embedding's gradient on a GPU: ``relax.grad.take_backward`` (rows of the output gradient
added into the rows of the table their token ids name), written with its threads bound.

TVM legalizes it as one sequential loop nest inside an opaque block, which no GPU schedule
rule can bind to threads (backend/gpu.py). Here one thread per column of the table zeroes that
column, then walks the tokens in order adding each token's gradient: the same sums in the same
order as the sequential loop (deterministic, no atomics), the threads of a warp reading
neighbouring columns.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

THREADS = 128


def is_take_backward(func: tirx.PrimFunc) -> bool:
    """TVM's legalized take_backward: an output gradient [tokens, columns], the table
    [rows, columns] (its shape only) and 1-D token ids, writing [rows, columns]."""
    block = getattr(func.body, "block", None)
    return len(func.params) == 4 and block is not None and block.name_hint == "take_backward"


def take_backward_gpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` (see ``is_take_backward``) with its threads bound, for a 2-D table gathered
    along axis 0 (an embedding); another shape is a ValueError naming it."""
    grad, table, ids, out = func.params
    shapes = [[int(d) for d in b.shape] for b in (grad, table, ids)]
    if len(shapes[0]) != 2 or len(shapes[1]) != 2 or shapes[0][1] != shapes[1][1]:
        raise ValueError(f"take_backward on the GPU takes a [tokens, columns] gradient of a "
                         f"[rows, columns] table gathered along axis 0; got {shapes}")
    (tokens, columns), (rows, _) = shapes[0], shapes[1]
    return take_backward_kernel(tokens, rows, columns, str(table.dtype), str(ids.dtype))


def take_backward_kernel(tokens: int, rows: int, columns: int, dtype: str, id_dtype: str
                         ) -> tirx.PrimFunc:
    blocks = (columns + THREADS - 1) // THREADS

    @T.prim_func(private=True, s_tir=True)
    def take_backward(grad: T.Buffer((tokens, columns), dtype),
                      table: T.Buffer((rows, columns), dtype),
                      ids: T.Buffer((tokens,), id_dtype), out: T.Buffer((rows, columns), dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                column: T.let[T.int64] = T.int64(bx * THREADS + tx)
                if column < columns:
                    for r in T.serial(rows):
                        out[r, column] = T.cast(0, dtype)
                    for t in T.serial(tokens):
                        out[ids[t], column] = out[ids[t], column] + grad[t, column]

    return take_backward
