"""The matrix-product kernel every float32 product of a training step becomes
(pipelines/transform/isolate_gemms.py): c = op(a) @ op(b), marked opaque so fusion keeps it
whole and a CPU build can switch it to OpenBLAS (pipelines/backend/blas.py). Its second operand
may be a frozen weight stored as bfloat16 or int8 (transform/store_frozen_weights.py): each
element is widened to float32 as the product reads it, so the sums are the float32 product's (an
int8 weight's row scales are applied around the product, by the step)."""
from __future__ import annotations

from tvm import te, tirx

from pipelines.ir import OPAQUE

GEMM = "pockengine_gemm"  # PrimFunc attribute: the transposes, "nn", "nt", "tn" or "tt"


def gemm_kernel(shape_a: list[int], shape_b: list[int], trans: str,
                dtype_b: str = "float32") -> tirx.PrimFunc:
    """c = op(a) @ op(b) over equal leading axes; op transposes the last two axes for "t"; b
    of ``dtype_b``, read as float32."""
    a = te.placeholder(shape_a, "float32", "A")
    b = te.placeholder(shape_b, dtype_b, "B")
    m = shape_a[-1] if trans[0] == "t" else shape_a[-2]
    n = shape_b[-2] if trans[1] == "t" else shape_b[-1]
    depth = shape_a[-2] if trans[0] == "t" else shape_a[-1]
    k = te.reduce_axis((0, depth), "k")

    def product(*index):
        *lead, i, j = index
        left = a[(*lead, k, i)] if trans[0] == "t" else a[(*lead, i, k)]
        right = b[(*lead, j, k)] if trans[1] == "t" else b[(*lead, k, j)]
        if dtype_b != "float32":  # a float32 kernel stays as it was (tuning records match it)
            right = right.astype("float32")
        return te.sum(left * right, axis=k)

    c = te.compute([*shape_a[:-2], m, n], product, name="gemm")
    func = te.create_prim_func([a, b, c]).without_attr("global_symbol")  # named by the module
    return func.with_attrs({GEMM: trans, "op_pattern": OPAQUE})
