"""Gradient rules that TVM 0.27's Relax lacks and the reference models need (MobileNetV2:
clip, batch_norm; the LLaMA-style decoder: rsqrt in RMSNorm, strided_slice in rotary
embeddings, with strides where they interleave; MiniLM: layer_norm and exact GELU, plus erf and
tanh-approximated GELU; Hugging Face transformers: index_tensor (a classifier reading each
sequence's last token; gather_nd, the same in an ONNX export), max/min and tril (attention
masks); Keras: pad (ZeroPadding2D; negative widths cut, as F.fold's export does); a user's
own modules: squeeze, topk, gather_elements and scatter_elements (routing,
torch.gather/scatter); index_put (x[i, j] = v); slice_scatter (a slice written in place: linear
attention's state, chunked caches), tile (DiffLlama's heads) and flip (a causal conv's
reversed windows), stack (ONNX's Max of several tensors)), the layers in layer_rules.py, the
elementwise ops in unary_rules.py, and the ones TVM gets wrong (where, for broadcast operands;
conv2d, for dilated kernels; avg_pool2d, for windows ceil mode cuts; relu and abs, at 0:
REPLACED).

Each rule is checked numerically against PyTorch autograd in tests/test_gradient_rules.py.
Rules are registered once, on import; a rule TVM later ships itself is left in place (but
REPLACED ones are replaced). Then every rule, TVM's included, is wrapped so that gradients pass
between float values only: integer and boolean values (positions, masks, shapes) are left out
of the gradient.
"""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.op import (add, astype, broadcast_to, collapse_sum_to, divide, equal, erf, exp,
                          expand_dims, gather_elements, gather_nd, greater, less, logical_and,
                          mean, multiply, reshape, scatter_elements, scatter_nd, sign, sqrt, stack,
                          strided_slice, subtract, sum as rsum, tanh, tril, variance, where,
                          zeros_like)
from tvm.relax.op.base import register_gradient
from tvm.relax.op.nn import pad as pad_zeros
from tvm.relax.op._op_gradient import no_grad

from pipelines.ir import dtype_of, shape_of
from pipelines.training.layer_rules import LAYER_REPLACED, LAYER_RULES, normalised_grad
from pipelines.training.unary_rules import UNARY_RULES


def clip_grad(orig_var, orig_call, output_grad, ctx):
    """y = clip(x, lo, hi) (ReLU6 is clip(x, 0, 6)): dx = dy where lo < x < hi, as PyTorch's
    hardtanh_backward, which passes no gradient at the bounds themselves."""
    x, lo, hi = orig_call.args
    dtype = dtype_of(x)
    inside = logical_and(greater(x, relax.const(float(lo.value), dtype)),
                         less(x, relax.const(float(hi.value), dtype)))
    return [where(inside, output_grad, zeros_like(output_grad)), no_grad(lo), no_grad(hi)]


def batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """(y, new_mean, new_var) = batch_norm(x, gamma, beta, mean, var).

    Training mode normalises with batch statistics, so the classic fused form applies:
    dx = gamma * rstd / N * (N * dy - sum(dy) - xhat * sum(dy * xhat)),
    dgamma = sum(dy * xhat), dbeta = sum(dy). Eval mode is affine in x.
    Only y carries gradient; the running statistics are state, not differentiable.
    """
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    attrs = orig_call.attrs
    axis = int(attrs.axis)
    dims = shape_of(x)
    reduce_axes = [i for i in range(len(dims)) if i != axis]
    bshape = [dims[i] if i == axis else 1 for i in range(len(dims))]
    dtype = dtype_of(x)
    dy = relax.TupleGetItem(output_grad, 0)
    eps = relax.const(float(attrs.epsilon), dtype)
    if attrs.training:
        mu = mean(x, reduce_axes, keepdims=True)
        rstd = divide(relax.const(1.0, dtype), sqrt(add(variance(x, reduce_axes, keepdims=True),
                                                        eps)))
    else:
        mu = reshape(moving_mean, bshape)
        rstd = divide(relax.const(1.0, dtype), sqrt(add(reshape(moving_var, bshape), eps)))
    xhat = multiply(subtract(x, mu), rstd)
    dbeta = rsum(dy, reduce_axes)
    dgamma = rsum(multiply(dy, xhat), reduce_axes)
    scale = multiply(reshape(gamma, bshape), rstd) if attrs.scale else rstd
    if attrs.training:
        n = 1
        for i in reduce_axes:
            n *= dims[i]
        centred = subtract(subtract(dy, reshape(divide(dbeta, relax.const(float(n), dtype)),
                                                bshape)),
                           multiply(xhat, reshape(divide(dgamma, relax.const(float(n), dtype)),
                                                  bshape)))
        dx = multiply(scale, centred)
    else:
        dx = multiply(scale, dy)
    return [dx, dgamma, dbeta, no_grad(moving_mean), no_grad(moving_var)]


def rsqrt_grad(orig_var, orig_call, output_grad, ctx):
    """y = 1 / sqrt(x): dx = -y^3 / 2 * dy."""
    dtype = dtype_of(orig_var)
    cube = multiply(orig_var, multiply(orig_var, orig_var))
    return [multiply(output_grad, multiply(relax.const(-0.5, dtype), cube))]


def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """y = x[begin:end:stride] along some axes (strides >= 1; every other channel, as in
    interleaved rotary embeddings): dx is dy spread back to the positions it was read from,
    zeros elsewhere. Per axis, seen as groups of ``stride`` positions: dy is padded to one
    element per group, each element gets its group's other positions as zeros around it (a
    new axis, padded), and the groups past x's end are cut. No index is ever shifted back by
    an offset: TVM's simplifier miscompiled the inlined kernel of the former construction
    (dy spread from position 0, then padded by ``begin``) in DeepSeek's interleaved rotary."""
    x = orig_call.args[0]
    dims = shape_of(x)
    axes, begin, end = ([int(v.value) for v in arg.fields] for arg in orig_call.args[1:4])
    strides = ([int(v.value) for v in orig_call.args[4].fields] if len(orig_call.args) > 4
               else [1] * len(axes))
    if any(s < 1 for s in strides):
        raise NotImplementedError(f"strided_slice gradient: strides >= 1 only (got {strides})")
    grad, shape = output_grad, list(shape_of(orig_var))
    for axis, b, e, stride in zip(axes, begin, end, strides):
        axis %= len(dims)
        b = min(max(b + dims[axis] if b < 0 else b, 0), dims[axis])
        e = min(max(e + dims[axis] if e < 0 else e, 0), dims[axis])
        count = max(0, -(-(e - b) // stride))
        groups, first = -(-dims[axis] // stride), b // stride
        widths = [0, 0] * len(dims)
        widths[2 * axis: 2 * axis + 2] = [first, groups - first - count]
        grad = pad_zeros(grad, widths)
        if stride > 1:
            widths = [0, 0] * (len(dims) + 1)
            widths[2 * axis + 2: 2 * axis + 4] = [b % stride, stride - 1 - b % stride]
            grad = reshape(pad_zeros(expand_dims(grad, axis + 1), widths),
                           shape[:axis] + [groups * stride] + shape[axis + 1:])
            if groups * stride > dims[axis]:
                grad = strided_slice(grad, [axis], [0], [dims[axis]])
        shape[axis] = dims[axis]
    return [grad] + [no_grad(arg) for arg in orig_call.args[1:]]


def squeeze_grad(orig_var, orig_call, output_grad, ctx):
    """y = x without some size-1 axes: dx is dy with them back."""
    return [reshape(output_grad, shape_of(orig_call.args[0]))]


def stack_grad(orig_var, orig_call, output_grad, ctx):
    """y = stack((x1, x2, ...), axis): each x's gradient is its slice of dy along the new
    axis, without that axis (ONNX's Max, Min, Mean and Sum of several tensors stack them)."""
    axis = int(orig_call.attrs.axis) % len(shape_of(orig_var))
    parts = orig_call.args[0].ty.fields
    return [relax.Tuple([reshape(strided_slice(output_grad, [axis], [i], [i + 1]),
                                 [int(d) for d in part.shape]) for i, part in enumerate(parts)])]


def flip_grad(orig_var, orig_call, output_grad, ctx):
    """y = x reversed along an axis: dx is dy reversed back."""
    return [relax.op.flip(output_grad, int(orig_call.attrs.axis))]


def topk_grad(orig_var, orig_call, output_grad, ctx):
    """(values, indices) = topk(x, k, axis): each value's gradient goes back to the position it
    was taken from (a mixture-of-experts router's chosen logits); the others get none."""
    x = orig_call.args[0]
    attrs = orig_call.attrs
    if attrs.ret_type != "both":
        raise NotImplementedError(f"topk gradient: ret_type 'both' only (got {attrs.ret_type})")
    values_grad = relax.TupleGetItem(output_grad, 0)
    indices = astype(relax.TupleGetItem(orig_var, 1), "int64")
    return [scatter_elements(zeros_like(x), indices, values_grad, int(attrs.axis), "add")]


def gather_elements_grad(orig_var, orig_call, output_grad, ctx):
    """y = gather_elements(x, indices, axis) (torch.gather): dx is zeros with dy added where
    each element was read from, repeats accumulating."""
    x, indices = orig_call.args
    return [scatter_elements(zeros_like(x), indices, output_grad, int(orig_call.attrs.axis),
                             "add"), no_grad(indices)]


def scatter_elements_grad(orig_var, orig_call, output_grad, ctx):
    """y = scatter_elements(data, indices, updates, axis, reduction): each update's gradient is
    dy where it was written (gathered back); data's is dy, less the positions an update
    replaced (reduction "update") or all of it (reduction "add"). A maximum or minimum
    ("max", "min": scatter_reduce's amax, amin) shares dy among the values equal to it, data's
    and updates', as PyTorch does."""
    data, indices, updates = orig_call.args
    axis, reduction = int(orig_call.attrs.axis), orig_call.attrs.reduction
    if reduction in ("max", "min"):
        dtype = dtype_of(data)
        data_ties = astype(equal(data, orig_var), dtype)
        update_ties = astype(equal(updates, gather_elements(orig_var, indices, axis)), dtype)
        ties = add(data_ties, scatter_elements(zeros_like(data), indices, update_ties, axis,
                                               "add"))  # at least 1: y is one of them
        share = divide(output_grad, ties)
        return [multiply(share, data_ties), no_grad(indices),
                multiply(gather_elements(share, indices, axis), update_ties)]
    if reduction not in ("update", "add"):
        raise NotImplementedError(f"scatter_elements gradient: reduction 'update', 'add', "
                                  f"'max' or 'min' only (got {reduction!r})")
    data_grad = (output_grad if reduction == "add" else
                 scatter_elements(output_grad, indices, zeros_like(updates), axis))
    return [data_grad, no_grad(indices), gather_elements(output_grad, indices, axis)]


def slice_scatter_grad(orig_var, orig_call, output_grad, ctx):
    """y = x with src written over x[start:end:step] along ``axis``: dx is dy with that slice
    zeroed, dsrc is dy's slice."""
    x, src, start, end, step = orig_call.args
    axis = int(orig_call.attrs.axis) % len(shape_of(x))
    begin, stop, stride = (int(v) for v in (start, end, step))
    return [relax.op.slice_scatter(output_grad, zeros_like(src), begin, stop, stride, axis),
            strided_slice(output_grad, [axis], [begin], [stop], [stride])] + [
        no_grad(arg) for arg in orig_call.args[2:]]


def tile_grad(orig_var, orig_call, output_grad, ctx):
    """y = tile(x, repeats): each element of x appears in every repeat, so dx sums dy's repeats.
    dy viewed as [r0, d0, r1, d1, ...] (x's shape with leading 1s to the repeats' length),
    summed over the r axes."""
    x = orig_call.args[0]
    repeats = [int(r) for r in orig_call.attrs.repeats]
    dims = shape_of(x)
    rank = max(len(dims), len(repeats))
    repeats = [1] * (rank - len(repeats)) + repeats
    padded = [1] * (rank - len(dims)) + list(dims)
    split = [v for r, d in zip(repeats, padded) for v in (r, d)]
    summed = rsum(reshape(output_grad, split), list(range(0, 2 * rank, 2)))
    return [reshape(summed, dims)]


def pad_grad(orig_var, orig_call, output_grad, ctx):
    """y = x padded with a constant (low, high per axis; a negative width cuts, as PyTorch's
    ``constant_pad_nd`` does after ``F.fold``): dx is the slice of dy where x's kept part
    sits, padded with zeros where x was cut."""
    x = orig_call.args[0]
    widths = [int(w) for w in orig_call.attrs.pad_width]
    if orig_call.attrs.pad_mode != "constant":
        raise NotImplementedError("pad gradient: only constant padding (got "
                                  f"{orig_call.attrs.pad_mode!r})")
    dims = shape_of(x)
    low, high = widths[0::2], widths[1::2]
    kept = [d - max(0, -lo) - max(0, -hi) for d, lo, hi in zip(dims, low, high)]
    begin = [max(0, lo) for lo in low]
    grad = strided_slice(output_grad, list(range(len(dims))), begin,
                         [b + k for b, k in zip(begin, kept)])
    if min(widths) >= 0:
        return [grad]
    return [pad_zeros(grad, [max(0, -w) for w in widths])]

def _positions(indices, ctx, dims: list[int]):
    """The index tensors of an advanced indexing of ``dims``' leading axes (a Relax tuple),
    broadcast together, negative ones counted from the end as in PyTorch, stacked on a last
    axis: scatter_nd's and gather_nd's positions."""
    fields = (list(indices.fields) if isinstance(indices, relax.Tuple) else
              [relax.TupleGetItem(indices, i) for i in range(len(indices.ty.fields))])
    fields = [ctx.normalize(field) for field in fields]
    common = list(np.broadcast_shapes(*(tuple(shape_of(f)) for f in fields)))
    positions = []
    for axis, field in enumerate(fields):
        index = astype(broadcast_to(field, common), "int64")
        wrapped = add(index, relax.const(dims[axis], "int64"))
        positions.append(where(less(index, relax.const(0, "int64")), wrapped, index))
    return stack(positions, axis=-1), common


def index_tensor_grad(orig_var, orig_call, output_grad, ctx):
    """y = x[i0, i1, ...] (advanced indexing of the leading axes, the indices broadcast
    together; e.g. a classifier reading each sequence's last token): dx is zeros with dy added
    at the indexed positions, repeats accumulating, as PyTorch's index_put with accumulate."""
    x, indices = orig_call.args
    dims = shape_of(x)
    positions, _ = _positions(indices, ctx, dims)
    zeros = relax.op.zeros(relax.ShapeExpr(dims), dtype_of(x))
    return [scatter_nd(zeros, positions, output_grad, reduction="add"), no_grad(indices)]


def index_put_grad(orig_var, orig_call, output_grad, ctx):
    """y = index_put(x, (i0, i1, ...), v, accumulate): x with v written (or added) at the
    positions (``x[i, j] = v`` or ``+=``, every axis indexed). dx is dy, zero where v was
    written over x; dv is dy read at the positions, summed over the axes v was broadcast
    along. Positions written twice (not added) take the gradient of both writes."""
    x, indices, values = orig_call.args
    dims = shape_of(x)
    positions, common = _positions(indices, ctx, dims)
    picked = ctx.normalize(gather_nd(output_grad, positions))
    dvalues = (picked if shape_of(picked) == shape_of(values)
               else collapse_sum_to(picked, values.ty.shape))
    if orig_call.attrs.accumulate:
        return [output_grad, no_grad(indices), dvalues]
    depth = len(orig_call.args[1].ty.fields)  # the axes indexed
    zeros = relax.op.zeros(relax.ShapeExpr(common + dims[depth:]), dtype_of(x))
    return [scatter_nd(output_grad, positions, zeros, reduction="update"), no_grad(indices),
            dvalues]


def gather_nd_grad(orig_var, orig_call, output_grad, ctx):
    """y = gather_nd(x, i) (ONNX GatherND: the last axis of i indexes x's leading axes; an
    exported classifier reading each sequence's last token): dx is zeros with dy added at the
    gathered positions, repeats accumulating. Batch dimensions are not handled."""
    x, indices = orig_call.args
    if orig_call.attrs.batch_dims:
        raise NotImplementedError("the gradient of gather_nd with batch_dims > 0")
    dims = shape_of(x)
    index = astype(indices, "int64")
    # negative positions count from the end, one axis per index column
    wrapped = add(index, relax.const(np.array(dims[:shape_of(indices)[-1]]), "int64"))
    index = where(less(index, relax.const(0, "int64")), wrapped, index)
    zeros = relax.op.zeros(relax.ShapeExpr(dims), dtype_of(x))
    return [scatter_nd(zeros, index, output_grad, reduction="add"), no_grad(indices)]


def extremum_grad(orig_var, orig_call, output_grad, ctx):
    """y = max(x, axes) (or min): dy goes to the positions holding the extremum, shared equally
    among ties, as torch.amax / amin."""
    x = orig_call.args[0]
    rank, axes = len(shape_of(x)), orig_call.attrs.axis

    def kept(value):  # ``value`` with the reduced axes back, as size 1
        if orig_call.attrs.keepdims:
            return value
        if axes is None:
            return reshape(value, [1] * rank)
        return expand_dims(value, sorted(int(a) % rank for a in axes))

    hits = astype(equal(x, kept(orig_var)), dtype_of(x))
    return [multiply(hits, divide(kept(output_grad), rsum(hits, axes, keepdims=True)))]


def tril_grad(orig_var, orig_call, output_grad, ctx):
    """y = tril(x, k): the kept triangle passes dy through."""
    return [tril(output_grad, orig_call.args[1]), no_grad(orig_call.args[1])]


def erf_grad(orig_var, orig_call, output_grad, ctx):
    """y = erf(x): dx = 2 / sqrt(pi) * exp(-x^2) * dy."""
    x = orig_call.args[0]
    dtype = dtype_of(x)
    density = exp(multiply(relax.const(-1.0, dtype), multiply(x, x)))
    return [multiply(output_grad, multiply(relax.const(2 / math.sqrt(math.pi), dtype), density))]


def gelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x * Phi(x), Phi the standard normal CDF: dx = (Phi(x) + x * phi(x)) * dy."""
    x = orig_call.args[0]
    dtype = dtype_of(x)
    cdf = multiply(relax.const(0.5, dtype), add(relax.const(1.0, dtype),
                                                erf(multiply(x, relax.const(math.sqrt(0.5),
                                                                            dtype)))))
    pdf = multiply(relax.const(1 / math.sqrt(2 * math.pi), dtype),
                   exp(multiply(relax.const(-0.5, dtype), multiply(x, x))))
    return [multiply(output_grad, add(cdf, multiply(x, pdf)))]


def gelu_tanh_grad(orig_var, orig_call, output_grad, ctx):
    """y = x/2 * (1 + tanh(u)), u = sqrt(2/pi) * (x + 0.044715 x^3):
    dx = (1/2 * (1 + t) + x/2 * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)) * dy."""
    x = orig_call.args[0]
    dtype = dtype_of(x)

    def c(v):
        return relax.const(v, dtype)

    x2 = multiply(x, x)
    t = tanh(multiply(c(math.sqrt(2 / math.pi)), add(x, multiply(c(0.044715), multiply(x2, x)))))
    du = multiply(c(math.sqrt(2 / math.pi)), add(c(1.0), multiply(c(3 * 0.044715), x2)))
    dx = add(multiply(c(0.5), add(c(1.0), t)),
             multiply(multiply(c(0.5), x), multiply(subtract(c(1.0), multiply(t, t)), du)))
    return [multiply(output_grad, dx)]


def layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = xhat * gamma + beta, xhat = (x - mean) * rstd over ``axes``:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma (means over ``axes``),
    dgamma = sum(dy * xhat), dbeta = sum(dy) over the other axes: the fused form, with no
    decomposed mean/variance graph to differentiate."""
    x, gamma, beta = orig_call.args
    attrs = orig_call.attrs
    axes = [int(a) % len(shape_of(x)) for a in attrs.axes]
    g = multiply(output_grad, gamma) if attrs.scale else output_grad
    dx, xhat = normalised_grad(x, g, axes, attrs.epsilon, dtype_of(x))
    dgamma = (collapse_sum_to(multiply(output_grad, xhat), gamma.ty.shape) if attrs.scale
              else no_grad(gamma))
    dbeta = collapse_sum_to(output_grad, beta.ty.shape) if attrs.center else no_grad(beta)
    return [dx, dgamma, dbeta]


RULES = {
    "relax.clip": clip_grad,
    "relax.nn.batch_norm": batch_norm_grad,
    "relax.rsqrt": rsqrt_grad,
    "relax.strided_slice": strided_slice_grad,
    "relax.nn.pad": pad_grad,
    "relax.index_tensor": index_tensor_grad,
    "relax.index_put": index_put_grad,
    "relax.gather_nd": gather_nd_grad,
    "relax.max": extremum_grad,
    "relax.min": extremum_grad,
    "relax.tril": tril_grad,
    "relax.erf": erf_grad,
    "relax.nn.gelu": gelu_grad,
    "relax.nn.gelu_tanh": gelu_tanh_grad,
    "relax.nn.layer_norm": layer_norm_grad,
    "relax.squeeze": squeeze_grad,
    "relax.topk": topk_grad,
    "relax.scatter_elements": scatter_elements_grad,
    "relax.gather_elements": gather_elements_grad,
    "relax.slice_scatter": slice_scatter_grad,
    "relax.tile": tile_grad,
    "relax.flip": flip_grad,
    "relax.stack": stack_grad,
    **LAYER_RULES,
    **UNARY_RULES,
}


def where_grad(orig_var, orig_call, output_grad, ctx):
    """y = where(c, a, b), a and b broadcast to y's shape (an attention mask's fill value is a
    0-d tensor): da = where(c, dy, 0) summed back to a's shape, db = where(c, 0, dy) to b's.
    TVM's rule leaves both y's shape."""
    cond, a, b = orig_call.args

    def to_shape_of(grad, operand):  # unchanged where nothing was broadcast
        same = shape_of(operand) == shape_of(orig_var)
        return grad if same else collapse_sum_to(grad, operand.ty.shape)

    return [no_grad(cond),
            to_shape_of(where(cond, output_grad, relax.const(0, dtype_of(a))), a),
            to_shape_of(where(cond, relax.const(0, dtype_of(b)), output_grad), b)]


def relu_grad(orig_var, orig_call, output_grad, ctx):
    """y = relu(x): dx = dy where x > 0, as PyTorch's threshold_backward. TVM's rule passes
    dy at x == 0 too: a ReLU after a zero-initialised bias on a zero input (Swin V2's
    position-bias MLP at the window's centre) gets a gradient PyTorch does not give it."""
    x = orig_call.args[0]
    zero = relax.const(0, dtype_of(x))
    return [where(greater(x, zero), output_grad, zero)]


def abs_grad(orig_var, orig_call, output_grad, ctx):
    """y = |x|: dx = dy * sign(x), 0 at x == 0 as in PyTorch (TVM's rule gives dy there)."""
    return [multiply(output_grad, sign(orig_call.args[0]))]


# TVM's rules replaced by the project's, where they are wrong for an input a model gives
REPLACED = {"relax.where": where_grad, "relax.nn.relu": relu_grad, "relax.abs": abs_grad,
            **LAYER_REPLACED}

_OVERRIDE = 11  # the level our wrappers register at: above the one TVM registers its rules at


# Ops that have no rule: ops_without_gradient names them where a gradient must cross one; off
# that path (a position table from tile or arange, an attention bias from the input alone)
# TVM's Gradient pass still visits them, and gets ``_off_path``.
NO_RULE: set[str] = set()


def register() -> None:
    """Register the project's rules for ops that have none in this TVM; then make every rule
    pass gradients between float values only (``_float_only``)."""
    for op_name, rule in RULES.items():
        op = tvm.ir.Op.get(op_name)
        if op.get_attr("FPrimalGradient") is None:
            register_gradient(op_name, rule)
    for op_name in tvm.ir.Op.list_op_names():
        if not op_name.startswith("relax."):
            continue
        rule = REPLACED.get(op_name) or tvm.ir.Op.get(op_name).get_attr("FPrimalGradient")
        if rule is None:
            NO_RULE.add(op_name)
            rule = _off_path
        register_gradient(op_name, _float_only(rule), level=_OVERRIDE)


def _off_path(orig_var, orig_call, output_grad, ctx):
    """An op with no rule, on a value no parameter reaches (graph.py checks that first): what
    would flow back from it could never reach a parameter."""
    return [no_grad(arg) for arg in orig_call.args]


def _float_only(rule):
    """``rule`` where no gradient enters an integer or boolean value. TVM's Gradient pass sends
    an adjoint to every argument a rule gives a partial for, so a mask built from the inputs
    (``equal``, ``cumsum``, ``astype`` to bool) would otherwise carry bool "gradients" back
    into ops that have no rule or no code for them."""

    def wrapped(orig_var, orig_call, output_grad, ctx):
        if not carries_gradient(orig_var):
            return [no_grad(arg) for arg in orig_call.args]
        partials = rule(orig_var, orig_call, output_grad, ctx)
        return [partial if carries_gradient(arg) else no_grad(arg)
                for arg, partial in zip(orig_call.args, partials)]

    return wrapped


# ops whose result does not depend on their first argument's values, only on its shape
SHAPE_ONLY = {"relax.zeros_like", "relax.ones_like", "relax.full_like", "relax.shape_of"}


def stops_gradient(value: relax.Expr) -> bool:
    """Whether ``value`` is a detached one (``R.grad.no_grad``: PyTorch's detach, a no_grad
    block's result) or one made from its argument's shape only (MRA's attention without its
    kernels: ``zeros_like(query)``), which no gradient crosses."""
    if not isinstance(value, relax.Call):
        return False
    name = getattr(value.op, "name", "")
    # a fill value that the parameters compute (full_like's second argument) passes its own on
    return name == "relax.grad.no_grad" or name in SHAPE_ONLY and all(
        isinstance(arg, tvm.ir.expr.Constant) for arg in value.args[1:])


def carries_gradient(expr: relax.Expr) -> bool:
    """Whether a gradient can flow through ``expr``: a float tensor or a tuple holding one (a
    comparison's mask or an index does not, even when computed from the parameters)."""
    return _float_type(expr.ty)


def _float_type(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_float_type(field) for field in ty.fields)
    return isinstance(ty, relax.TensorType) and ty.dtype is not None and _is_float(ty.dtype)


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def gradient_reaches(func: relax.Function) -> set[relax.Var]:
    """The vars of ``func`` that the gradient of its output (the first field of a tuple: the
    logits, not the batch statistics) reaches: through float values, not detached ones."""
    out = func.body.body
    reached = set(relax.analysis.free_vars(out.fields[0] if isinstance(out, relax.Tuple)
                                           else out))
    for block in reversed(func.body.blocks):
        for binding in reversed(block.bindings):
            if binding.var in reached and carries_gradient(binding.var) and \
                    not stops_gradient(binding.value):
                reached.update(relax.analysis.free_vars(binding.value))
    return reached


def ops_without_gradient(func: relax.Function, wrt=None) -> list[tuple[str, str]]:
    """(op name, binding var name) of each bound call in ``func`` that has no gradient rule and
    that a gradient flows through: one whose value depends on a var of ``wrt`` (default: every
    parameter of ``func``) and that the output's gradient reaches. Integer and shape
    computations from the inputs alone (position ids, masks, the index of a sequence's last
    token) and what is only read detached need no gradient and are left out."""
    varying, reached = set(func.params if wrt is None else wrt), gradient_reaches(func)
    missing = []
    for block in func.body.blocks:
        for binding in block.bindings:
            used = relax.analysis.free_vars(binding.value)
            if not any(v in varying for v in used) or not carries_gradient(binding.var) \
                    or stops_gradient(binding.value):
                continue
            varying.add(binding.var)
            if binding.var not in reached:
                continue
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and (
                    value.op.get_attr("FPrimalGradient") is None or value.op.name in NO_RULE):
                missing.append((value.op.name, binding.var.name))
    return missing


register()
