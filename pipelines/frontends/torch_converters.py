"""Converters for core ATen operators that TVM 0.27's exported-program importer does not
convert and that common layers export to: ``amax`` (global max pooling, attention masks),
``clamp`` of integers with one bound, ``scatter_add`` and ``scatter_reduce``,
``_embedding_bag`` (nn.EmbeddingBag) and ``adaptive_max_pool2d``; ``index.Tensor`` as
PyTorch indexes (TVM's conversion read a negative index out of bounds) and ``index_put`` with
whole axes among its indices (``F.fold``) or a boolean mask and a shared value; ops PyTorch
computes in floating point from integer inputs (``log``, ``sqrt``, true division:
FLOAT_RESULTS), which TVM's refuse; division rounded toward zero or down (``div`` with a
``rounding_mode``) in its result's dtype; ``arange`` counting down in integers;
``Tensor.unfold``; ``detach``; complex values (held as ``view_as_real`` holds them): Fourier
transforms, ``polar`` and products (rotary embeddings as rotations); ``topk`` with
``sorted=False`` (mixture-of-experts routing), which TVM refuses; ``cat`` with an empty 1-D
operand (which PyTorch skips; a multimodal model's absent image features); and for 2-D
interpolation, which TVM converts to ``image.resize2d``, an op with no gradient. Each emits
Relax operators that have gradient rules, so the layer trains.

A converter takes (FX node, importer) and returns the Relax value, as TVM's own do."""
from __future__ import annotations

import operator

import numpy as np
import torch
from tvm import relax
from tvm.relax.op import (add, astype, broadcast_to, concat, divide, expand_dims, floor,
                          floor_divide, floor_mod, full_like, greater, greater_equal, less,
                          logical_and, matmul, max as rmax, maximum, minimum, multiply, negative,
                          not_equal, ones_like, permute_dims, scatter_elements, strided_slice,
                          subtract, sum as rsum, take, trunc, where, zeros_like)
from tvm.relax.op.nn import max_pool2d

from pipelines.frontends.export_rewrites import module_of
from pipelines.ir import dtype_of, shape_of
from pipelines.schema import ConfigError


def _arg(node, index: int, default):
    return node.args[index] if len(node.args) > index else default


def _only_first_output(node, what: str) -> None:
    """The ops below return (values, bookkeeping...); only the values are converted."""
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            raise NotImplementedError(f"{what}: only its first output is supported, but "
                                      f"{user.name} reads another")


def clamp(node, importer):
    """aten.clamp / clamp_min / clamp_max of an integer tensor (T5Gemma's relative position
    buckets): TVM's conversion gives a missing bound as +-inf, which an integer clip cannot
    hold (its build stops: "Cannot convert infinity"); the bounds given are applied alone."""
    name = node.target.__name__.split(".")[0]
    x = importer.env[node.args[0]]
    if "int" not in dtype_of(x):
        return getattr(importer, f"_{name}")(node)
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if name == "clamp_max":
        low, high = None, low
    for bound, limit in ((low, maximum), (high, minimum)):
        if bound is not None:
            x = importer.block_builder.emit(limit(x, relax.const(int(bound), dtype_of(x))))
    return x


def amax(node, importer):
    """aten.amax(x, dims, keepdim): the max over ``dims`` (all of them when empty)."""
    x = importer.env[node.args[0]]
    dims = list(_arg(node, 1, [])) or None
    return importer.block_builder.emit(rmax(x, dims, bool(_arg(node, 2, False))))


def scatter_add(node, importer):
    """aten.scatter_add(x, dim, index, src): src's elements added at ``index`` along ``dim``.
    Only the part of src that index covers is read, as in PyTorch."""
    x, dim, index, src = (importer.env.get(a, a) for a in node.args[:4])
    src = _covered(src, index)
    return importer.block_builder.emit(scatter_elements(x, index, src, int(dim), "add"))


def _covered(src, index):
    """The part of ``src`` that ``index`` covers (a scatter reads no more of it)."""
    if shape_of(src) == shape_of(index):
        return src
    rank = len(shape_of(index))
    return strided_slice(src, list(range(rank)), [0] * rank, shape_of(index))


# scatter_reduce's reductions: TVM's name, and the value a reduction starts from
REDUCTIONS = {"sum": ("add", 0), "prod": ("mul", 1), "amax": ("max", -np.inf),
              "amin": ("min", np.inf)}


def scatter_reduce(node, importer):
    """aten.scatter_reduce.two(x, dim, index, src, reduce, include_self=True): src's elements
    reduced into x at ``index`` along ``dim`` (sum, prod, mean, amax, amin: TAPAS's segment
    means and minima). TVM's reductions always start from x's value; without include_self, a
    position written to starts from the reduction's identity instead, and a mean counts only
    what was written there (plus x's value with include_self), as in PyTorch."""
    x, dim, index, src = (importer.env.get(a, a) for a in node.args[:4])
    reduce = node.args[4]
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    emit, dim, src = importer.block_builder.emit, int(dim), _covered(src, index)
    dtype = dtype_of(x)
    if reduce == "mean":
        if "float" not in dtype:
            raise NotImplementedError("scatter_reduce mean of integers (PyTorch rounds it)")
        kept = relax.const(1.0 if include_self else 0.0, dtype)
        start = x if include_self else emit(scatter_elements(x, index, zeros_like(src), dim))
        sums = emit(scatter_elements(start, index, src, dim, "add"))
        counts = emit(scatter_elements(full_like(x, kept), index, ones_like(src), dim, "add"))
        return emit(where(greater(counts, relax.const(0.0, dtype)),
                          divide(sums, maximum(counts, relax.const(1.0, dtype))), x))
    mode, identity = REDUCTIONS[reduce]
    if not include_self:
        if "float" not in dtype and np.isinf(identity):
            info = np.iinfo(dtype)
            identity = info.min if identity < 0 else info.max
        starts = broadcast_to(relax.const(identity, dtype), shape_of(src))  # not full_like:
        x = emit(scatter_elements(x, index, starts, dim))  # TVM cannot build a full of -inf
    return emit(scatter_elements(x, index, src, dim, mode))


def index_tensor(node, importer):
    """aten.index.Tensor(x, indices): x indexed by tensors along some axes (None: the whole
    axis), as PyTorch does it: the indices broadcast together and zipped; their result's axes
    where the first indexed axis was when the indexed axes are adjacent, else first; a
    negative index counted from the end (Falcon reads its key and value heads at [-2] and
    [-1]). TVM's conversion read negative indices before the tensor and took two 1-D indices
    with a whole axis before them (ConvBERT's) as an outer product."""
    x, indices = importer.retrieve_args(node)[:2]
    emit, rank = importer.block_builder.emit, len(shape_of(x))
    wrapped = {}
    for axis, index in enumerate(indices):
        if index is not None:
            size = relax.const(shape_of(x)[axis], dtype_of(index))
            wrapped[axis] = emit(where(less(index, relax.const(0, dtype_of(index))),
                                       add(index, size), index))
    chosen = sorted(wrapped)
    if len(chosen) == 1:
        return emit(take(x, wrapped[chosen[0]], axis=chosen[0]))
    rest = [a for a in range(rank) if a not in wrapped]
    if chosen + rest != list(range(rank)):  # the indexed axes first: index_tensor's
        x = emit(permute_dims(x, chosen + rest))
    y = emit(relax.op.index_tensor(x, [wrapped[a] for a in chosen]))
    first, zipped = chosen[0], len(shape_of(y)) - len(rest)
    if first > 0 and chosen == list(range(first, first + len(chosen))):
        y = emit(permute_dims(y, [zipped + j for j in range(first)] + list(range(zipped))
                              + [zipped + j for j in range(first, len(rest))]))
    return y


def select(node, importer):
    """aten.select.int(x, dim, index): x's slice at ``index`` along ``dim``, a negative index
    counted from the end (``h[:, -1]``: XLNet's summary of its last token). TVM's conversion
    took it as an offset before the tensor and read out of bounds."""
    x = importer.env[node.args[0]]
    shape = shape_of(x)
    dim = int(node.args[1]) % len(shape)
    index = relax.const(int(node.args[2]) % shape[dim], "int64")
    return importer.block_builder.emit(take(x, index, axis=dim))


def index_put(node, importer):
    """aten.index_put(x, indices, v, accumulate) with whole axes (None) among the indices, as
    PyTorch writes it: ``x[:, :, i, j] = v`` (``F.fold``'s sum of patches, MobileViT-v2's).
    Each whole axis becomes an arange along its own axis of the indexed shape (the zipped
    indices' axes where the first indexed axis was when the indexed axes are adjacent, else
    first, as PyTorch places them), so that every index and v broadcast to that shape. TVM's
    conversion gave every whole axis's arange the same leading axis, which do not broadcast."""
    x, indices, values = importer.retrieve_args(node)[:3]
    accumulate = bool(_arg(node, 3, node.kwargs.get("accumulate", False)))
    if any(i is not None and "int" not in dtype_of(i) for i in indices):
        return _masked_put(node, importer, x, indices, values, accumulate)
    if all(i is not None for i in indices):
        return importer._index_put(node)
    emit, dims = importer.block_builder.emit, shape_of(x)
    indices = list(indices) + [None] * (len(dims) - len(indices))
    chosen = [a for a, i in enumerate(indices) if i is not None]
    zipped = list(np.broadcast_shapes(*(tuple(shape_of(indices[a])) for a in chosen)))
    first = chosen[0] if chosen == list(range(chosen[0], chosen[0] + len(chosen))) else 0
    whole = [a for a in range(len(dims)) if indices[a] is None]
    # the indexed shape: whole axes before ``first``, the zipped shape, the other whole axes
    place = {a: k if k < first else k + len(zipped) for k, a in enumerate(whole)}
    rank = len(whole) + len(zipped)
    full = []
    for axis, index in enumerate(indices):
        if index is None:
            shape = [1] * rank
            shape[place[axis]] = dims[axis]
            full.append(emit(relax.op.reshape(
                relax.op.arange(0, dims[axis], 1, "int64"), shape)))
        else:
            shape = [1] * (len(zipped) - len(shape_of(index))) + shape_of(index)
            index = relax.op.reshape(index, [1] * first + shape + [1] * (rank - first -
                                                                     len(zipped)))
            full.append(emit(astype(index, "int64")))
    return emit(relax.op.index_put(x, relax.Tuple(full), values, accumulate))


def _masked_put(node, importer, x, indices, values, accumulate: bool):
    """``x[mask] = v`` (or ``+=``) with one boolean mask over x's leading axes, and a ``v``
    that every selected element or row shares (broadcast to x's other axes): the same as
    ``where(mask, v, x)``, with static shapes (T5Gemma 2's). A ``v`` with a value per selected
    element is as many values as the mask holds, which the data decides: refused."""
    mask = indices[0]
    rest, dims = len(shape_of(x)) - len(shape_of(mask)), shape_of(x)
    if len(indices) != 1 or shape_of(mask) != dims[:len(shape_of(mask))] or \
            len(shape_of(values)) > rest or any(
                v not in (1, d) for v, d in zip(reversed(shape_of(values)), reversed(dims))):
        raise ConfigError(f"{module_of(node)} writes x[mask] = v with a value per selected "
                          "element: as many as the mask holds, a number the data decides, and "
                          "a compiled step's shapes are static; write torch.where(mask, v, x)")
    emit = importer.block_builder.emit
    selected = emit(relax.op.reshape(mask, shape_of(mask) + [1] * rest))
    written = broadcast_to(astype(values, dtype_of(x)), dims)
    if accumulate:
        return emit(add(x, where(selected, written, zeros_like(x))))
    return emit(where(selected, written, x))


def embedding_bag(node, importer):
    """aten._embedding_bag(weight, indices, offsets, scale_grad, mode, sparse,
    per_sample_weights, include_last_offset, padding_idx): each bag (indices[offsets[j]:
    offsets[j + 1]]) sums or averages its rows of ``weight``. As a product: a [bags, indices]
    membership matrix (the padding index left out, per-sample weights applied, divided by
    each bag's size for the mean) times the rows taken, so the weight's gradient is take's and
    matmul's."""
    _only_first_output(node, "embedding_bag")
    bb, env = importer.block_builder, importer.env
    weight, indices, offsets = (env[a] for a in node.args[:3])
    mode = int(_arg(node, 4, 0))
    per_sample = _arg(node, 6, None)
    include_last, padding = bool(_arg(node, 7, False)), _arg(node, 8, None)
    if mode == 2:
        raise NotImplementedError("embedding_bag with mode='max'")
    if _arg(node, 3, False):
        raise NotImplementedError("embedding_bag with scale_grad_by_freq=True")
    count = shape_of(indices)[0]
    bags = shape_of(offsets)[0] - int(include_last)
    offsets = astype(offsets, "int64")
    starts = strided_slice(offsets, [0], [0], [bags])
    ends = concat([strided_slice(offsets, [0], [1], [bags]),
                   relax.const([count], "int64")]) if not include_last else \
        strided_slice(offsets, [0], [1], [bags + 1])
    positions = relax.const(np.arange(count, dtype="int64")[None])
    member = logical_and(greater_equal(positions, expand_dims(starts, 1)),
                         less(positions, expand_dims(ends, 1)))
    if padding is not None and int(padding) >= 0:
        member = logical_and(member, not_equal(expand_dims(astype(indices, "int64"), 0),
                                               relax.const(int(padding), "int64")))
    dtype = dtype_of(weight)
    weights = bb.emit(astype(member, dtype))
    if per_sample is not None:
        weights = multiply(weights, expand_dims(env[per_sample], 0))
    if mode == 1:
        size = maximum(rsum(astype(member, dtype), [1], keepdims=True), relax.const(1.0, dtype))
        weights = divide(weights, size)
    return bb.emit(relax.Tuple([bb.emit(matmul(weights, take(weight, indices, axis=0)))]))


def adaptive_max_pool2d(node, importer):
    """aten.adaptive_max_pool2d(x, output_size) where the input divides into equal windows:
    max pooling with that window as kernel and stride (what PyTorch computes then)."""
    _only_first_output(node, "adaptive_max_pool2d")
    x = importer.env[node.args[0]]
    height, width = shape_of(x)[-2:]
    out_h, out_w = (int(v) if v is not None else d
                    for v, d in zip(node.args[1], (height, width)))
    if height % out_h or width % out_w:
        raise NotImplementedError(f"adaptive_max_pool2d from {height}x{width} to "
                                  f"{out_h}x{out_w}: unequal windows are not supported")
    window = (height // out_h, width // out_w)
    bb = importer.block_builder
    return bb.emit(relax.Tuple([bb.emit(max_pool2d(x, window, window))]))


def topk(node, importer):
    """aten.topk(x, k, dim, largest, sorted): the k largest (or smallest) along ``dim``, values
    and indices. ``sorted=False`` leaves the order to the implementation, so the sorted order
    (all TVM's topk gives) is one PyTorch allows."""
    x = importer.env[node.args[0]]
    k, dim, largest = int(_arg(node, 1, 1)), int(_arg(node, 2, -1)), bool(_arg(node, 3, True))
    return importer.block_builder.emit(
        relax.op.topk(x, k=k, axis=dim, largest=largest, ret_type="both", dtype="int64"))


def cat(node, importer):
    """aten.cat(tensors, dim): PyTorch skips operands of shape (0,) whatever the others' rank
    (its legacy rule; a multimodal model with no image in the batch concatenates its empty
    image features so), where TVM's concat refuses mixed ranks; and operands empty along
    ``dim`` (a causal conv's empty cache before its context), whose section of the gradient's
    split TVM refuses."""
    given = [importer.env[n] for n in node.args[0]]
    tensors = [t for t in given if shape_of(t) != [0]] or given[:1]
    axis = int(_arg(node, 1, node.kwargs.get("dim", 0))) % len(shape_of(tensors[0]))
    tensors = [t for t in tensors if shape_of(t)[axis] != 0] or tensors[:1]
    if len(tensors) == 1:
        return tensors[0]
    return importer.block_builder.emit(concat(tensors, axis=axis))


def interpolate(node, importer):
    """aten.upsample_{nearest,bilinear,bicubic}2d: each mode is separable and linear in its
    input, y = A_h @ x @ A_w^T. The two matrices are PyTorch's own weights, read by running the
    op on one-hot rows and columns, so sizes, scales and align_corners mean what they mean
    there; the gradient is matmul's."""
    x = importer.env[node.args[0]]
    height, width = shape_of(x)[-2:]
    args, kwargs = node.args[1:], node.kwargs
    rows = torch.eye(height).reshape(height, 1, height, 1).expand(-1, -1, -1, width)
    cols = torch.eye(width).reshape(width, 1, 1, width).expand(-1, -1, height, -1)
    with torch.no_grad():
        along_h = node.target(rows.contiguous(), *args, **kwargs)[:, 0, :, 0].T
        along_w = node.target(cols.contiguous(), *args, **kwargs)[:, 0, 0, :]
    dtype = dtype_of(x)
    rows_mixed = matmul(relax.const(along_h.numpy().astype(dtype)), x)
    return importer.block_builder.emit(
        matmul(rows_mixed, relax.const(along_w.numpy().astype(dtype))))


def div_rounded(node, importer):
    """aten.div.Tensor_mode(a, b, rounding_mode="trunc" or "floor") as PyTorch computes it: in
    the result's dtype, a number operand a constant of that dtype, integers rounded toward
    zero or down exactly. TVM's made a number an int32 constant, which an int64 tensor cannot
    be divided by (JetMoE's ``expert_index.div(top_k, rounding_mode="trunc")``)."""
    mode = _arg(node, 2, None) or node.kwargs.get("rounding_mode")
    if mode not in ("trunc", "floor"):
        raise NotImplementedError(f"{node.name}: div rounding_mode {mode!r}; allowed: "
                                  "'trunc', 'floor'")
    want = str(node.meta["val"].dtype).removeprefix("torch.")
    a, b = (relax.const(value, want) if not isinstance(value, relax.Expr)
            else value if dtype_of(value) == want else astype(value, want)
            for value in (importer.env.get(arg, arg) for arg in node.args[:2]))
    emit = importer.block_builder.emit
    if "float" in want:
        return emit((trunc if mode == "trunc" else floor)(divide(a, b)))
    down = emit(floor_divide(a, b))
    if mode == "floor":
        return down
    # toward zero: one up from floor where the division is inexact and the signs differ
    zero = relax.const(0, want)
    up = logical_and(not_equal(floor_mod(a, b), zero), not_equal(less(a, zero), less(b, zero)))
    return emit(where(up, add(down, relax.const(1, want)), down))


def arange(node, importer):
    """aten.arange.start_step(start, end, step) counting down in integers, as PyTorch does:
    negated, the count up from -start. TVM's length ceil-divides as for a step above zero
    (arange(8, -8, -1) had 18 elements, not 16: Funnel's relative positions)."""
    bounds = [_arg(node, 0, None), _arg(node, 1, None), _arg(node, 2, 1)]
    if (any(not isinstance(b, int) for b in bounds) or bounds[2] > 0
            or node.meta["val"].dtype.is_floating_point):
        return importer._arange(node)
    want = str(node.meta["val"].dtype).removeprefix("torch.")
    start, end, step = bounds
    return importer.block_builder.emit(negative(relax.op.arange(-start, -end, -step, want)))


def unfold(node, importer):
    """aten.unfold(x, dim, size, step) (``Tensor.unfold``: sliding windows, as a causal conv
    reads its context): the windows along ``dim``, each one's elements on a new last axis; a
    take of x at window * step + offset, its offset axis moved last."""
    x = importer.env[node.args[0]]
    shape = shape_of(x)
    dim, size, step = int(node.args[1]) % len(shape), int(node.args[2]), int(node.args[3])
    starts = np.arange((shape[dim] - size) // step + 1) * step
    index = relax.const((starts[:, None] + np.arange(size)).astype("int64"))
    order = [a for a in range(len(shape) + 1) if a != dim + 1] + [dim + 1]
    return importer.block_builder.emit(permute_dims(take(x, index, axis=dim), order))


def detach(node, importer):
    """aten.detach(x): x, through which no gradient flows (TVM's conversion was x itself, so a
    straight-through estimator's or a no_grad block's gradient flowed on)."""
    return importer.block_builder.emit(relax.op.grad.no_grad(importer.env[node.args[0]]))


# A complex tensor is held as PyTorch's view_as_real holds it: a float tensor with a last axis
# of 2 (real, imaginary). Only the ops below read one, so any other reader is refused.
COMPLEX_READERS = ("_fft_c2c.default", "_conj.default", "view_as_real.default", "mul.Tensor",
                   "unsqueeze.default", "_assert_tensor_metadata.default")


def _pair(real, imag):
    """(real, imaginary) on a new last axis (concatenated: Relax's stack has no gradient)."""
    return concat([expand_dims(real, -1), expand_dims(imag, -1)], axis=-1)


def _is_complex(arg) -> bool:
    return isinstance(arg, torch.fx.Node) and getattr(
        arg.meta.get("val"), "dtype", torch.float32).is_complex


def _complex_result(node) -> None:
    """Refuse ``node``'s complex result where an op not converted for complex values reads
    it."""
    for user in node.users:
        if getattr(user.target, "__name__", None) not in COMPLEX_READERS:
            raise NotImplementedError(f"{user.name} ({user.target}) reads the complex tensor "
                                      f"{node.name}; only {', '.join(COMPLEX_READERS)} are "
                                      "converted")


def _parts(arg, importer):
    """A complex operand as its (real, imaginary) parts; a real one as (it, None)."""
    if not _is_complex(arg):
        return importer.env.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg, None
    z = importer.env[arg]
    last = len(shape_of(z)) - 1
    return tuple(importer.block_builder.emit(take(z, relax.const(i, "int64"), axis=last))
                 for i in (0, 1))


def _complex(node, importer):
    """``node``'s input as (real, imaginary) parts, a real one with a zero imaginary part;
    the node's readers checked."""
    _complex_result(node)
    real, imag = _parts(node.args[0], importer)
    if imag is not None:
        return [real, imag]
    if "float" not in dtype_of(real):
        raise NotImplementedError(f"{node.name}: a complex value of a {dtype_of(real)} tensor")
    return [real, relax.op.zeros_like(real)]


def complex_or(convert, convert_complex):
    """TVM's ``convert`` of an op, or ``convert_complex`` where it reads a complex tensor."""

    def either(node, importer):
        if any(_is_complex(arg) for arg in node.args):
            return convert_complex(node, importer)
        return convert(node)

    return either


def polar(node, importer):
    """aten.polar(r, theta): r cos(theta) + i r sin(theta) (LLaMA 4's and DeepSeek V2's
    rotary embeddings turn positions into rotations so)."""
    _complex_result(node)
    r, theta = (importer.env[arg] for arg in node.args[:2])
    return importer.block_builder.emit(_pair(multiply(r, relax.op.cos(theta)),
                                             multiply(r, relax.op.sin(theta))))


def view_as_complex(node, importer):
    """aten.view_as_complex(x): x's last axis of 2 is the (real, imaginary) pair already."""
    _complex_result(node)
    return importer.env[node.args[0]]


def complex_multiply(node, importer):
    """aten.mul(z, w) with a complex operand: (a + ib)(c + id) = ac - bd + i(ad + bc); a real
    operand (a tensor or a number) scales both parts."""
    _complex_result(node)
    (a, b), (c, d) = (_parts(arg, importer) for arg in node.args[:2])
    if b is None or d is None:
        (real, imag), scale = ((c, d), a) if b is None else ((a, b), c)
        if not isinstance(scale, relax.Expr):
            scale = relax.const(scale, dtype_of(real))
        parts = multiply(real, scale), multiply(imag, scale)
    else:
        parts = subtract(multiply(a, c), multiply(b, d)), add(multiply(a, d), multiply(b, c))
    return importer.block_builder.emit(_pair(*parts))


def complex_unsqueeze(node, importer):
    """aten.unsqueeze(z, dim) of a complex z: ``dim`` counted from z's own axes, not the
    pair's."""
    _complex_result(node)
    dim = int(node.args[1])
    if dim < 0:
        dim += len(node.args[0].meta["val"].shape) + 1
    return importer.block_builder.emit(expand_dims(importer.env[node.args[0]], dim))


def _fourier(parts, dims, normalization: int, forward: bool, emit):
    """The discrete Fourier transform of (real, imaginary) along each of ``dims`` as products
    with its cosine and sine matrices (n x n: fine for the sequence and hidden sizes FNet
    mixes), scaled as ``normalization`` says (0: none, 1: 1/sqrt(n), 2: 1/n)."""
    shape, dtype = shape_of(parts[0]), dtype_of(parts[0])
    rank = len(shape)
    for dim in (int(d) % rank for d in dims):
        n = shape[dim]
        angle = 2 * np.pi * np.outer(np.arange(n), np.arange(n)) / n
        scale = {0: 1.0, 1: 1 / np.sqrt(n), 2: 1 / n}[normalization]
        cos = relax.const((np.cos(angle) * scale).astype(dtype))
        sin = relax.const((np.sin(angle) * scale * (1 if forward else -1)).astype(dtype))
        order = [a for a in range(rank) if a != dim] + [dim]
        back = [order.index(a) for a in range(rank)]
        real, imag = (permute_dims(part, order) for part in parts)
        # (re + i im)(cos -+ i sin): re cos +- im sin, im cos -+ re sin
        parts = [emit(permute_dims(add(matmul(real, cos), matmul(imag, sin)), back)),
                 emit(permute_dims(subtract(matmul(imag, cos), matmul(real, sin)), back))]
    return parts


def to_complex(node, importer):
    """aten._to_copy(x, dtype=complex64): x as the real part, zero imaginary part (FNet's
    ``fftn(x).real``); any other copy is TVM's."""
    dtype = node.kwargs.get("dtype")
    if dtype is None or not dtype.is_complex:
        return importer._to_copy(node)
    return importer.block_builder.emit(_pair(*_complex(node, importer)))


def fft(node, importer):
    """aten._fft_c2c(z, dims, normalization, forward) and aten._fft_r2c(x, dims,
    normalization, onesided) (``torch.fft.fft`` and its kin): the transform of ``_fourier``;
    a one-sided one keeps the last axis' first n // 2 + 1."""
    dims, normalization = node.args[1], int(node.args[2])
    emit, r2c = importer.block_builder.emit, "r2c" in node.target.__name__
    forward, onesided = (True, bool(node.args[3])) if r2c else (bool(node.args[3]), False)
    parts = _fourier(_complex(node, importer), dims, normalization, forward, emit)
    if onesided:
        axis = int(dims[-1]) % len(shape_of(parts[0]))
        kept = shape_of(parts[0])[axis] // 2 + 1
        parts = [strided_slice(part, [axis], [0], [kept]) for part in parts]
    return emit(_pair(*parts))


def conj(node, importer):
    """aten._conj(z): the imaginary part negated."""
    real, imag = _complex(node, importer)
    return importer.block_builder.emit(_pair(real, negative(imag)))


def view_as_real(node, importer):
    """aten.view_as_real(z): the complex tensor as held here already."""
    return importer.env[node.args[0]]

# ops whose result PyTorch makes floating point whatever its inputs' dtype
FLOAT_RESULTS = [f"{op}.default" for op in (
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "exp", "expm1",
    "log", "log2", "log10", "log1p", "reciprocal", "rsqrt", "sigmoid", "sin", "sinh", "sqrt",
    "tan", "tanh")] + ["div.Scalar", "div.Tensor"]


def float_inputs(convert):
    """TVM's converter ``convert`` of an op of FLOAT_RESULTS, its integer inputs cast to the
    result's dtype first, as PyTorch promotes them (Ministral 3's attention scale is the log
    of a position)."""

    def promoted(node, importer):
        want = getattr(node.meta.get("val"), "dtype", None)
        if want is None or not want.is_floating_point:
            return convert(node)
        saved = {}
        for arg in node.args:
            value = importer.env.get(arg) if isinstance(arg, torch.fx.Node) else None
            if isinstance(getattr(value, "ty", None), relax.TensorType) and \
                    "float" not in dtype_of(value):
                saved[arg] = value
                importer.env[arg] = importer.block_builder.emit(
                    astype(value, str(want).removeprefix("torch.")))
        try:
            return convert(node)
        finally:
            importer.env.update(saved)

    return promoted


CONVERTERS = {
    "upsample_nearest2d.vec": interpolate,
    "upsample_bilinear2d.vec": interpolate,
    "upsample_bicubic2d.vec": interpolate,
    "amax.default": amax,
    **dict.fromkeys(["clamp.default", "clamp_min.default", "clamp_max.default"], clamp),
    "scatter_add.default": scatter_add,
    "scatter_reduce.two": scatter_reduce,
    "select.int": select,
    "index.Tensor": index_tensor,
    "index_put.default": index_put,
    "_embedding_bag.default": embedding_bag,
    "adaptive_max_pool2d.default": adaptive_max_pool2d,
    "topk.default": topk,
    "cat.default": cat,
    "div.Tensor_mode": div_rounded,
    "div.Scalar_mode": div_rounded,
    "arange.start_step": arange,
    "_to_copy.default": to_complex,
    "_fft_c2c.default": fft,
    "_fft_r2c.default": fft,
    "_conj.default": conj,
    "view_as_real.default": view_as_real,
    "unfold.default": unfold,
    "detach.default": detach,
    "polar.default": polar,
    "view_as_complex.default": view_as_complex,
}
# ops TVM converts for real tensors, converted here where one reads a complex tensor
COMPLEX_AWARE = {"mul.Tensor": complex_multiply, "unsqueeze.default": complex_unsqueeze}
