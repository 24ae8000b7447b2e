"""Gradient rules for layers TVM 0.27 gives no rule: 1-D convolutions (plain and transposed;
the conv stems of audio and sequence models), 2-D transposed convolutions (decoders,
upsampling), 3-D convolutions and max pooling (video), group and instance norm. A 1-D layer is
the 2-D one over a height of 1, so its rule is the 2-D rule on views with that axis added
(TVM's own conv2d rule; the transposed one below). Two of TVM's rules are replaced: conv2d's
(dilated kernels) and avg_pool2d's (windows that ceil mode cuts).

Each is checked numerically against PyTorch autograd in tests/test_gradient_rules.py and in
a whole step in tests/test_operator_corpus.py.
"""
from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.op import (add, astype, cumsum, divide, equal, expand_dims, logical_and, mean,
                          multiply, permute_dims, reshape, sqrt, squeeze, strided_slice,
                          subtract, sum as rsum, variance)
from tvm.relax.op._op_gradient import no_grad
from tvm.relax.op.grad import avg_pool2d_backward
from tvm.relax.op.nn import conv2d, conv2d_transpose, conv3d, conv3d_transpose

from pipelines.ir import dtype_of, shape_of


def _on_height_one(ctx, call2d, output_grad, rule):
    """``rule``'s partials for the 2-D ``call2d`` (a 1-D layer with a height-1 axis added),
    ``output_grad`` given that axis too; the partials come back without it."""
    view = ctx.normalize(call2d)  # typed, for the rule's shape reads; never emitted
    return [squeeze(partial, [2]) for partial in
            rule(view, view, expand_dims(output_grad, 2), ctx)]


def _check_layouts(attrs, data: str, kernel: str) -> None:
    if attrs.data_layout != data or attrs.kernel_layout != kernel:
        raise NotImplementedError(f"gradient of a {data}/{kernel} layer only (got "
                                  f"{attrs.data_layout}/{attrs.kernel_layout})")


def _output_padding(ins, out, strides, padding, dilation, kernel) -> list[int]:
    """Per spatial axis, the rows a transposed conv of the output must add to give the input's
    size back (``padding``: all low sides, then all high sides, as Relax lists them)."""
    rank = len(ins)
    return [i - ((o - 1) * s - lo - hi + d * (k - 1) + 1) for i, o, s, lo, hi, d, k
            in zip(ins, out, strides, padding[:rank], padding[rank:], dilation, kernel)]


def conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv2d(x, w), NCHW/OIHW: TVM's rule, but with the data gradient's output padding
    computed for dilated kernels (TVM's leaves the dilation out of the size and fails on
    them): dx = conv2d_transpose(dy, w), and dw a conv2d over the batch (x read as
    [channels, batch, ...], dy as the kernel, stride and dilation swapped), cut to size."""
    x, w = orig_call.args
    a = orig_call.attrs
    _check_layouts(a, "NCHW", "OIHW")
    strides, dilation = [int(v) for v in a.strides], [int(v) for v in a.dilation]
    padding, groups = [int(v) for v in a.padding], int(a.groups)
    batch, channels = shape_of(x)[:2]
    out, ins, kernel = shape_of(orig_var)[2:], shape_of(x)[2:], shape_of(w)[2:]
    output_padding = _output_padding(ins, out, strides, padding, dilation, kernel)
    dx = conv2d_transpose(output_grad, w, strides, padding, output_padding, dilation, groups,
                          kernel_layout="IOHW", out_dtype=a.out_dtype)
    data = x
    if groups != 1:  # each group's channels as batch entries of their own
        data = reshape(permute_dims(reshape(x, [batch, groups, channels // groups] + ins),
                                    [1, 0, 2, 3, 4]),
                       [batch * groups, channels // groups] + ins)
    dw = conv2d(data, output_grad, strides=dilation, padding=padding, dilation=strides,
                groups=groups, data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW",
                out_dtype=a.out_dtype)
    full = [(i - (o - 1) * s - 1 + lo + hi) // d + 1 for i, o, s, lo, hi, d
            in zip(ins, out, strides, padding[:2], padding[2:], dilation)]
    if full != kernel:
        dw = strided_slice(dw, [0, 1, 2, 3], [0, 0, 0, 0], list(shape_of(w)))
    return [dx, dw]


def conv1d_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv1d(x, w) over [batch, channels, length]: conv2d's rule on [batch, channels, 1,
    length] and a [out, in, 1, width] kernel."""
    x, w = orig_call.args
    a = orig_call.attrs
    _check_layouts(a, "NCW", "OIW")
    call2d = conv2d(expand_dims(x, 2), expand_dims(w, 2), strides=(1, int(a.strides[0])),
                    padding=(0, int(a.padding[0]), 0, int(a.padding[1])),
                    dilation=(1, int(a.dilation[0])), groups=int(a.groups),
                    out_dtype=a.out_dtype)
    return _on_height_one(ctx, call2d, output_grad, conv2d_grad)


def conv2d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv2d_transpose(x, w), w [in, out / groups, kh, kw]: the transpose of conv2d(., w)
    with the same strides, padding, dilation and groups, so dx = conv2d(dy, w) (read as
    [out=in, in=out / groups] it is conv2d's kernel as is; the output padding only adds rows
    that conv2d's stride never reads), and dw is that conv2d's weight gradient with dy as
    its input and x as its output's gradient."""
    x, w = orig_call.args
    a = orig_call.attrs
    _check_layouts(a, "NCHW", "IOHW")
    if int(a.groups) != 1:
        raise NotImplementedError(f"gradient of a grouped conv2d_transpose (groups {a.groups})")
    forward = conv2d(output_grad, w, strides=a.strides, padding=a.padding, dilation=a.dilation,
                     groups=1, out_dtype=a.out_dtype)
    view = ctx.normalize(forward)
    _, dw = conv2d_grad(view, view, x, ctx)
    return [forward, dw]


def conv1d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv1d_transpose(x, w): conv2d_transpose's rule on views of height 1."""
    x, w = orig_call.args
    a = orig_call.attrs
    _check_layouts(a, "NCW", "IOW")
    call2d = conv2d_transpose(
        expand_dims(x, 2), expand_dims(w, 2), strides=(1, int(a.strides[0])),
        padding=(0, int(a.padding[0]), 0, int(a.padding[1])),
        output_padding=(0, int(a.output_padding[0])), dilation=(1, int(a.dilation[0])),
        groups=int(a.groups), out_dtype=a.out_dtype)
    return _on_height_one(ctx, call2d, output_grad, conv2d_transpose_grad)


def conv3d_grad(orig_var, orig_call, output_grad, ctx):
    """y = conv3d(x, w), ungrouped: dx = conv3d_transpose(dy, w) with the output padding that
    gives x's size back; dw is a conv3d over the batch, as TVM's conv2d rule does in 2-D: x
    read as [channels, batch, ...] convolved with dy read as a [out, batch, ...] kernel, the
    stride and dilation swapped, then cut to the kernel's size."""
    x, w = orig_call.args
    a = orig_call.attrs
    _check_layouts(a, "NCDHW", "OIDHW")
    if int(a.groups) != 1:
        raise NotImplementedError(f"gradient of a grouped conv3d (groups {a.groups})")
    strides, dilation = [int(v) for v in a.strides], [int(v) for v in a.dilation]
    padding = [int(v) for v in a.padding]  # front, top, left, back, bottom, right
    out, ins, kernel = shape_of(orig_var)[2:], shape_of(x)[2:], shape_of(w)[2:]
    output_padding = _output_padding(ins, out, strides, padding, dilation, kernel)
    dx = conv3d_transpose(output_grad, w, strides, padding, output_padding, dilation,
                          kernel_layout="IODHW", out_dtype=a.out_dtype)
    dw = conv3d(permute_dims(x, [1, 0, 2, 3, 4]), permute_dims(output_grad, [1, 0, 2, 3, 4]),
                strides=dilation, padding=padding, dilation=strides, out_dtype=a.out_dtype)
    dw = strided_slice(dw, [2, 3, 4], [0, 0, 0], kernel)
    return [dx, permute_dims(dw, [1, 0, 2, 3, 4])]


def max_pool3d_grad(orig_var, orig_call, output_grad, ctx):
    """y = max_pool3d(x) over windows that tile x (stride = window, no padding or dilation,
    as video models pool): each window's dy goes to its first maximum in (depth, row,
    column) order, as PyTorch's max_pool3d_backward sends it to the index it kept."""
    x = orig_call.args[0]
    a = orig_call.attrs
    window = [int(v) for v in a.pool_size]
    dims = shape_of(x)
    if ([int(v) for v in a.strides] != window or any(int(v) for v in a.padding)
            or any(int(v) != 1 for v in a.dilation) or any(d % k for d, k in
                                                          zip(dims[2:], window))):
        raise NotImplementedError("gradient of max_pool3d whose windows tile the input only "
                                  f"(pool {window}, strides {list(a.strides)}, padding "
                                  f"{list(a.padding)}, input {dims[2:]})")
    pooled = [d // k for d, k in zip(dims[2:], window)]
    split = dims[:2] + [v for pair in zip(pooled, window) for v in pair]
    windows_last = [0, 1, 2, 4, 6, 3, 5, 7]
    size = window[0] * window[1] * window[2]
    xw = reshape(permute_dims(reshape(x, split), windows_last), dims[:2] + pooled + [size])
    hit = equal(xw, expand_dims(orig_var, -1))
    first = logical_and(hit, equal(cumsum(astype(hit, "int32"), axis=-1),
                                   relax.const(1, "int32")))
    grad = multiply(astype(first, dtype_of(x)), expand_dims(output_grad, -1))
    grad = reshape(grad, dims[:2] + pooled + window)
    return [reshape(permute_dims(grad, [0, 1, 2, 5, 3, 6, 4, 7]), dims)]


def avg_pool2d_grad(orig_var, orig_call, output_grad, ctx):
    """y = avg_pool2d(x), NCHW: TVM's rule divides each window's dy by the kernel's area, where
    the forward divides a window that ceil mode cuts (past the padding) by its cut size, as
    PyTorch does (EfficientNet's pooler, wider than its input, sent 1/144 of dy for 1/64). So
    dy is scaled by area / divisor per window, then TVM's backward counts padding in."""
    a = orig_call.attrs
    if a.layout != "NCHW" or any(int(v) != 1 for v in a.dilation):
        raise NotImplementedError(f"gradient of an undilated NCHW avg_pool2d only (got "
                                  f"{a.layout}, dilation {list(a.dilation)})")
    kernel, strides = [int(v) for v in a.pool_size], [int(v) for v in a.strides]
    padding = [int(v) for v in a.padding]
    sides = [_divisors(size, k, s, low, high, out, bool(a.count_include_pad))
             for size, k, s, low, high, out in zip(shape_of(orig_call.args[0])[2:], kernel,
                                                    strides, padding[:2], padding[2:],
                                                    shape_of(orig_var)[2:])]
    scale = kernel[0] * kernel[1] / np.outer(*sides)
    scaled = multiply(output_grad, relax.const(scale.astype(dtype_of(orig_var))))
    return [avg_pool2d_backward(scaled, orig_call.args[0], kernel, strides, padding,
                                [1, 1], bool(a.ceil_mode), True, "NCHW", a.out_layout)]


def _divisors(size: int, kernel: int, stride: int, low: int, high: int, out: int,
              include_pad: bool) -> np.ndarray:
    """Along one axis, each window's divisor in the forward (topi's pool, as PyTorch's):
    the window cut at the padding's end, and at the input's too unless padding counts."""
    starts = np.arange(out) * stride - low
    ends = np.minimum(starts + kernel, size + high)
    if not include_pad:
        starts, ends = np.maximum(starts, 0), np.minimum(ends, size)
    return (ends - starts).astype("float64")


def group_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = xhat * gamma + beta, xhat normalised over each group of channels (and the other
    axes): layer norm's fused form per group, on x viewed as [batch, groups, rest];
    dgamma = sum(dy * xhat), dbeta = sum(dy) over all but the channel axis."""
    x, gamma, beta = orig_call.args
    a = orig_call.attrs
    dims = shape_of(x)
    if int(a.channel_axis) != 1 or sorted(int(i) for i in a.axes) != list(range(2, len(dims))):
        raise NotImplementedError("gradient of group_norm over channels-first data only (got "
                                  f"channel_axis {a.channel_axis}, axes {list(a.axes)})")
    groups = int(a.num_groups)
    size = 1
    for d in dims[1:]:
        size *= d
    grouped = [dims[0], groups, size // groups]
    per_channel = [1, dims[1]] + [1] * (len(dims) - 2)
    g = multiply(output_grad, reshape(gamma, per_channel)) if a.scale else output_grad
    dx, xhat = normalised_grad(reshape(x, grouped), reshape(g, grouped), [2], a.epsilon,
                               dtype_of(x))
    return _with_affine_grads(reshape(dx, dims), reshape(xhat, dims), 1, orig_call, output_grad)


def instance_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = xhat * gamma + beta, xhat normalised over ``axes``, gamma and beta per channel
    (an image's channels; Bit's weight standardisation normalises each output channel of a
    kernel, axes [0, 2] of its [1, out, in * kh * kw] view): the same fused form over
    ``axes``."""
    x, gamma, _ = orig_call.args
    a = orig_call.attrs
    rank = len(shape_of(x))
    channel = int(a.channel_axis) % rank
    per_channel = [shape_of(x)[i] if i == channel else 1 for i in range(rank)]
    g = multiply(output_grad, reshape(gamma, per_channel)) if a.scale else output_grad
    dx, xhat = normalised_grad(x, g, [int(i) % rank for i in a.axes], a.epsilon, dtype_of(x))
    return _with_affine_grads(dx, xhat, channel, orig_call, output_grad)


def normalised_grad(x, g, axes: list[int], epsilon, dtype: str):
    """(dx, xhat) for xhat = (x - mean) * rstd over ``axes``, g the gradient reaching xhat:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))."""
    rstd = divide(relax.const(1.0, dtype), sqrt(add(variance(x, axes, keepdims=True),
                                                    relax.const(float(epsilon), dtype))))
    xhat = multiply(subtract(x, mean(x, axes, keepdims=True)), rstd)
    dx = multiply(rstd, subtract(subtract(g, mean(g, axes, keepdims=True)),
                                 multiply(xhat, mean(multiply(g, xhat), axes, keepdims=True))))
    return dx, xhat


def _with_affine_grads(dx, xhat, channel: int, orig_call, output_grad) -> list:
    """[dx, dgamma, dbeta]: dgamma = sum(dy * xhat), dbeta = sum(dy) over all but the channel
    axis."""
    _, gamma, beta = orig_call.args
    a = orig_call.attrs
    others = [i for i in range(len(shape_of(orig_call.args[0]))) if i != channel]
    dgamma = rsum(multiply(output_grad, xhat), others) if a.scale else no_grad(gamma)
    dbeta = rsum(output_grad, others) if a.center else no_grad(beta)
    return [dx, dgamma, dbeta]


# TVM's rules replaced by these, where they are wrong for an input a model gives
LAYER_REPLACED = {"relax.nn.conv2d": conv2d_grad, "relax.nn.avg_pool2d": avg_pool2d_grad}

LAYER_RULES = {
    "relax.nn.conv1d": conv1d_grad,
    "relax.nn.conv1d_transpose": conv1d_transpose_grad,
    "relax.nn.conv2d_transpose": conv2d_transpose_grad,
    "relax.nn.conv3d": conv3d_grad,
    "relax.nn.max_pool3d": max_pool3d_grad,
    "relax.nn.group_norm": group_norm_grad,
    "relax.nn.instance_norm": instance_norm_grad,
}
