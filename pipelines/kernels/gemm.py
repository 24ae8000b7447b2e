"""The matrix-product kernel every float32 product of a training step becomes
(pipelines/transform/isolate_gemms.py): c = op(a) @ op(b), marked opaque so fusion keeps it
whole and a CPU build can switch it to OpenBLAS (pipelines/backend/blas.py). Its second operand
may be a frozen weight stored as bfloat16 or int8 (transform/store_frozen_weights.py): each
element is widened to float32 as the product reads it, an int8 weight's times its row's scale (a
third operand), so the sums are the float32 product's of the weight the step stands for. A
library that multiplies float32 operands only (cuBLAS) reads such a weight widened first, by
``widen_kernel``, into a float32 copy that lives while the product runs."""
from __future__ import annotations

from tvm import te, tirx

from pipelines.ir import OPAQUE

GEMM = "pockengine_gemm"  # PrimFunc attribute: the transposes, "nn", "nt", "tn" or "tt"
# PrimFunc attribute of a kernel whose b is scaled by a third operand S: which axis of the
# product S runs along, "n" (the output's columns) or "k" (the summed one)
SCALE_AXIS = "pockengine_gemm_scale_axis"


def gemm_kernel(shape_a: list[int], shape_b: list[int], trans: str,
                dtype_b: str = "float32", scale_axis: str | None = None) -> tirx.PrimFunc:
    """c = op(a) @ op(b) over equal leading axes; op transposes the last two axes for "t"; b
    of ``dtype_b``, read as float32; with ``scale_axis`` ("n" or "k"), each element of op(b)
    times S's entry at its index along that axis (S: the scales of an int8 weight's rows, which
    are op(b)'s columns where it is read transposed and its rows where not)."""
    a = te.placeholder(shape_a, "float32", "A")
    b = te.placeholder(shape_b, dtype_b, "B")
    m = shape_a[-1] if trans[0] == "t" else shape_a[-2]
    n = shape_b[-2] if trans[1] == "t" else shape_b[-1]
    depth = shape_a[-2] if trans[0] == "t" else shape_a[-1]
    k = te.reduce_axis((0, depth), "k")
    scale = None if scale_axis is None else te.placeholder(
        [n if scale_axis == "n" else depth], "float32", "S")

    def product(*index):
        *lead, i, j = index
        left = a[(*lead, k, i)] if trans[0] == "t" else a[(*lead, i, k)]
        right = b[(*lead, j, k)] if trans[1] == "t" else b[(*lead, k, j)]
        if dtype_b != "float32":  # a float32 kernel stays as it was (tuning records match it)
            right = right.astype("float32")
        if scale is not None:
            right = right * scale[j if scale_axis == "n" else k]
        return te.sum(left * right, axis=k)

    c = te.compute([*shape_a[:-2], m, n], product, name="gemm")
    operands = [a, b, c] if scale is None else [a, b, scale, c]
    func = te.create_prim_func(operands).without_attr("global_symbol")  # named by the module
    attrs = {GEMM: trans, "op_pattern": OPAQUE}
    return func.with_attrs(attrs if scale is None else {**attrs, SCALE_AXIS: scale_axis})


def widen_kernel(shape: list[int], dtype: str, scaled: bool) -> tirx.PrimFunc:
    """W of ``dtype`` as float32, each row (first axis) times its scale in S where ``scaled``
    (an int8 weight's): the values the step stands for, rounded as stored_weights.dequantized
    rounds them (one float32 product per element)."""
    w = te.placeholder(shape, dtype, "W")
    scale = te.placeholder([shape[0]], "float32", "S") if scaled else None
    out = te.compute(shape, lambda *i: w[i].astype("float32") * scale[i[0]] if scaled
                     else w[i].astype("float32"), name="widen")
    operands = [w, scale, out] if scaled else [w, out]
    return te.create_prim_func(operands).without_attr("global_symbol")
