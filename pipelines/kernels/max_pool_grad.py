"""Max pooling's gradient, every read in bounds.

TVM's legalization of ``relax.grad.max_pool2d_backward`` (topi ``pool_grad``, 0.27) gives each
input element the output gradient of every window whose argmax it is. It finds those windows as
``(h + pad) // stride - k`` for k below ``ceil(size / stride)``, checks only that they start
at 0 or after, and reads the argmax of a window past the last one: ResNet's stem (3 x 3, stride
2, pad 1) reads one row and one column past the argmax buffer. Past a heap buffer that is a
read of whatever is there, and past an mmapped one (ResNet's stem at 64 x 64: 256 KiB of
argmax) a segfault now and then. Here the window index is clamped for the read, and a window
counts only where it exists: 0 <= o < out, and o * stride + size > h + pad.

The argmax takes the first maximum of a window in row-major order, as PyTorch's max pooling
does, so the gradient goes to the same element where values tie.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx, topi

LAYOUTS = ("NCHW", "NHWC")  # what the kernel takes; other layouts keep TVM's legalization


def _argmax():
    def combine(x, y):
        first = tirx.any(x[1] > y[1], tirx.all(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(first, x[0], y[0]), tirx.Select(first, x[1], y[1])

    def identity(index_dtype, value_dtype):
        return tirx.const(-1, index_dtype), te.min_value(value_dtype)

    return te.comm_reducer(combine, identity, name="argmax")


def max_pool2d_grad(out_grad: te.Tensor, data: te.Tensor, pool_size, strides, padding,
                    layout: str) -> te.Tensor:
    """The gradient of ``max_pool2d(data)`` (dilation 1, static shapes) for ``out_grad``."""
    h_axis, w_axis = layout.index("H"), layout.index("W")
    (kh, kw), (sh, sw) = [int(k) for k in pool_size], [int(s) for s in strides]
    top, left, bottom, right = [int(p) for p in padding]
    height, width = int(data.shape[h_axis]), int(data.shape[w_axis])
    out_h, out_w = int(out_grad.shape[h_axis]), int(out_grad.shape[w_axis])
    # ceil_mode's last window may reach past the padding: padded to cover every window
    bottom = max(bottom, (out_h - 1) * sh + kh - height - top)
    right = max(right, (out_w - 1) * sw + kw - width - left)
    before, after = [0] * len(data.shape), [0] * len(data.shape)
    before[h_axis], before[w_axis], after[h_axis], after[w_axis] = top, left, bottom, right
    lowest = float(np.finfo(np.float32).min)
    padded = topi.nn.pad(data, before, after, pad_value=lowest, name="padded")
    padded_width = width + left + right

    dh, dw = te.reduce_axis((0, kh), "dh"), te.reduce_axis((0, kw), "dw")
    argmax = _argmax()

    def window(*out):
        at = list(out)
        at[h_axis], at[w_axis] = out[h_axis] * sh + dh, out[w_axis] * sw + dw
        flat = (at[h_axis] * padded_width + at[w_axis]).astype("int64")
        return argmax((flat, padded[tuple(at)]), axis=[dh, dw])

    index, _ = te.compute(out_grad.shape, window, name="argmax")

    wh, ww = te.reduce_axis((0, -(-kh // sh)), "wh"), te.reduce_axis((0, -(-kw // sw)), "ww")

    def grad(*position):
        ph, pw = position[h_axis] + top, position[w_axis] + left
        oh, ow = tirx.floordiv(ph, sh) - wh, tirx.floordiv(pw, sw) - ww
        exists = tirx.all(oh >= 0, oh < out_h, oh * sh + kh > ph,
                          ow >= 0, ow < out_w, ow * sw + kw > pw)
        at = list(position)
        at[h_axis] = tirx.max(tirx.min(oh, out_h - 1), 0)
        at[w_axis] = tirx.max(tirx.min(ow, out_w - 1), 0)
        at = tuple(at)
        hit = tirx.all(exists, index[at] == (ph * padded_width + pw).astype("int64"))
        return te.sum(tirx.if_then_else(hit, out_grad[at], tirx.const(0.0, out_grad.dtype)),
                      axis=[wh, ww])

    return te.compute(data.shape, grad, name="max_pool2d_grad")
