"""Each gradient rule pockengine registers (pipelines/training/rules.py), and TVM's depthwise conv
rule that MobileNetV2 relies on, against PyTorch autograd: d/d(inputs) of sum(op(inputs) * r)
for a random r. Tolerance: rtol 1e-4, atol 1e-5 (elementwise rules, slices); batch norm and
layer norm rtol 1e-3, atol 1e-4 (reductions over the batch); depthwise conv rtol and atol 1e-4;
index_tensor, index_put, gather_nd, max/min (ties shared as amax) and tril rtol 1e-4, atol
1e-5.
An op without a rule is named with its binding, and the training graph's error names the
PyTorch layer it came from."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from pipelines.ir import tensor_type
from pipelines.training import rules  # registers the rules on import

TOL = dict(rtol=1e-4, atol=1e-5)


def relax_grads(make_output, shapes, values, weight):
    """Gradients of sum(make_output(*inputs) * weight) w.r.t. every input, via Relax Gradient."""
    inputs = [relax.Var(f"a{i}", tensor_type(s, "float32")) for i, s in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("f", inputs):
        with bb.dataflow():
            out = bb.emit(make_output(*inputs))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(out, relax.const(weight))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("f")(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    _, grads = vm["f_adjoint"](*[tvm.runtime.tensor(v) for v in values])
    return [g.numpy() for g in grads]


def torch_grads(fn, values, weight):
    tensors = [torch.tensor(v, requires_grad=True) for v in values]
    (fn(*tensors) * torch.tensor(weight)).sum().backward()
    return [t.grad.numpy() for t in tensors]


def test_clip_matches_hardtanh_backward():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 8, 5, 5)) * 4).astype("float32")
    x[0, 0, 0, :2] = [0.0, 6.0]  # exactly at the bounds: PyTorch passes no gradient there
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(lambda a: relax.op.clip(a, 0.0, 6.0), [x.shape], [x], w)
    want = torch_grads(lambda a: torch.nn.functional.relu6(a), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("op, reference", [(relax.op.nn.relu, torch.relu),
                                           (relax.op.abs, torch.abs)])
def test_relu_and_abs_at_zero_match_autograd(op, reference):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype("float32")
    x[0, :3] = 0.0  # a zero-initialised bias on a zero input: PyTorch passes nothing there
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(op, [x.shape], [x], w)
    want = torch_grads(reference, [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("shape", [(8, 6, 5, 5), (4, 3, 1, 1), (16, 10)])
def test_batch_norm_training_matches_autograd(shape):
    rng = np.random.default_rng(1)
    c = shape[1]
    x = (rng.standard_normal(shape) * 3 + 1).astype("float32")
    gamma = rng.uniform(0.5, 1.5, c).astype("float32")
    beta = rng.standard_normal(c).astype("float32")
    w = rng.standard_normal(shape).astype("float32")

    def bn_relax(a, g, b):
        stats = relax.const(np.zeros(c, "float32")), relax.const(np.ones(c, "float32"))
        return relax.TupleGetItem(relax.op.nn.batch_norm(a, g, b, *stats, axis=1,
                                                          epsilon=1e-5, training=True), 0)

    got = relax_grads(bn_relax, [shape, (c,), (c,)], [x, gamma, beta], w)
    want = torch_grads(lambda a, g, b: torch.nn.functional.batch_norm(
        a, None, None, g, b, training=True, eps=1e-5), [x, gamma, beta], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_autograd(approximate):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 9)) * 3).astype("float32")
    w = rng.standard_normal(x.shape).astype("float32")
    make = relax.op.nn.gelu if approximate == "none" else relax.op.nn.gelu_tanh
    got = relax_grads(make, [x.shape], [x], w)
    want = torch_grads(lambda a: torch.nn.functional.gelu(a, approximate=approximate), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_erf_matches_autograd():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((5, 7)) * 2).astype("float32")
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(relax.op.erf, [x.shape], [x], w)
    want = torch_grads(torch.erf, [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("shape, axes", [((4, 16, 24), [-1]), ((3, 5, 6), [1, 2])])
def test_layer_norm_matches_autograd(shape, axes):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype("float32")
    norm_shape = tuple(shape[a] for a in axes)
    gamma = rng.uniform(0.5, 1.5, norm_shape).astype("float32")
    beta = rng.standard_normal(norm_shape).astype("float32")
    w = rng.standard_normal(shape).astype("float32")
    got = relax_grads(lambda a, g, b: relax.op.nn.layer_norm(a, g, b, axes, epsilon=1e-12),
                      [shape, norm_shape, norm_shape], [x, gamma, beta], w)
    want = torch_grads(lambda a, g, b: torch.nn.functional.layer_norm(a, norm_shape, g, b,
                                                                      eps=1e-12),
                       [x, gamma, beta], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, rtol=1e-3, atol=1e-4)


def test_rsqrt_matches_autograd():
    rng = np.random.default_rng(3)
    x = rng.uniform(0.2, 4.0, (6, 7)).astype("float32")
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(relax.op.rsqrt, [x.shape], [x], w)
    np.testing.assert_allclose(got[0], torch_grads(torch.rsqrt, [x], w)[0], **TOL)


@pytest.mark.parametrize("axes, begin, end", [([2], [0], [3]), ([2], [3], [7]),
                                              ([0, 2], [1, 2], [3, 100]), ([1], [-3], [5])])
def test_strided_slice_matches_autograd(axes, begin, end):
    """Rotary embeddings split the head dimension in halves; clamped and negative bounds too."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5, 7)).astype("float32")
    index = [slice(None)] * 3
    for a, b, e in zip(axes, begin, end):
        index[a] = slice(b, e)
    w = rng.standard_normal(x[tuple(index)].shape).astype("float32")
    got = relax_grads(lambda a: relax.op.strided_slice(a, axes, begin, end), [x.shape], [x], w)
    want = torch_grads(lambda a: a[tuple(index)], [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("widths", [
    [0, 0, 0, 0, 0, 1, 2, 1],     # Keras's ZeroPadding2D: unequal on the two sides of an axis
    [0, 0, 0, 0, -1, 1, 2, -2]])  # F.fold's export cuts its padding off by negative widths
def test_constant_pad_matches_autograd(widths):
    """A constant pad, widths in relax order: (low, high) per axis."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 5)).astype("float32")
    out = [d + lo + hi for d, lo, hi in zip(x.shape, widths[0::2], widths[1::2])]
    w = rng.standard_normal(out).astype("float32")
    got = relax_grads(lambda a: relax.op.nn.pad(a, widths, "constant", 0.0), [x.shape], [x], w)
    torch_widths = [v for pair in reversed(list(zip(widths[0::2], widths[1::2]))) for v in pair]
    want = torch_grads(lambda a: torch.nn.functional.pad(a, torch_widths), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_where_reduces_a_broadcast_operands_gradient_to_its_shape():
    """An attention mask's fill: a 0-d value broadcast over the scores (ONNX exports keep it
    an initializer); and a row broadcast over a matrix."""
    rng = np.random.default_rng(6)
    cond = rng.random((3, 4)) > 0.5
    x = rng.standard_normal((3, 4)).astype("float32")
    fill, row = np.float32(-2.0), rng.standard_normal((1, 4)).astype("float32")
    w = rng.standard_normal((3, 4)).astype("float32")
    c = relax.const(cond)
    got = relax_grads(lambda a, b: relax.op.where(c, a, b), [x.shape, []], [x, fill], w)
    want = torch_grads(lambda a, b: torch.where(torch.tensor(cond), a, b), [x, fill], w)
    assert got[1].shape == ()
    np.testing.assert_allclose(got[1], want[1], **TOL)
    got = relax_grads(lambda a, b: relax.op.where(c, a, b), [row.shape, x.shape], [row, x], w)
    want = torch_grads(lambda a, b: torch.where(torch.tensor(cond), a, b), [row, x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_depthwise_conv_gradient_matches_autograd():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 9, 9)).astype("float32")
    k = rng.standard_normal((6, 1, 3, 3)).astype("float32")
    w = rng.standard_normal((2, 6, 5, 5)).astype("float32")
    got = relax_grads(lambda a, b: relax.op.nn.conv2d(a, b, strides=2, padding=1, groups=6),
                      [x.shape, k.shape], [x, k], w)
    want = torch_grads(lambda a, b: torch.nn.functional.conv2d(a, b, stride=2, padding=1,
                                                               groups=6), [x, k], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-4)


def test_op_without_rule_is_named_with_its_binding():
    x = relax.Var("x", tensor_type((3,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit(relax.op.atan2(x, x))
            bb.emit_output(out)
        bb.emit_func_output(out)
    missing = rules.ops_without_gradient(bb.get()["main"])
    assert missing == [("relax.atan2", out.name)]


def test_missing_rule_error_names_the_pytorch_layer():
    from pipelines.frontends.torch_program import translate
    from pipelines.training.graph import MissingGradientRule, build_train_step
    from pipelines.training.optimizers import SGD

    class Angle(torch.nn.Module):
        def forward(self, x):
            return torch.atan2(x, x + 1)

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Sequential(Angle()),
                                torch.nn.Linear(8, 3))
    program = torch.export.export(model, (torch.zeros(2, 4),))
    main, names, origins = translate(program)
    with pytest.raises(MissingGradientRule, match=r"relax\.atan2 in layer 1\.0 \(Angle\)"):
        build_train_step(main, len(names), SGD(lr=0.1), origins)


def test_index_tensor_matches_autograd_with_repeated_and_negative_indices():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 6, 3)).astype("float32")
    rows, cols = np.array([0, 4, 4, -1]), np.array([[1], [5], [5], [-2]])  # broadcast to (4, 4)
    w = rng.standard_normal((4, 4, 3)).astype("float32")
    got = relax_grads(lambda a: relax.op.index_tensor(
        a, relax.Tuple([relax.const(rows), relax.const(cols)])), [x.shape], [x], w)
    want = torch_grads(lambda a: a[torch.tensor(rows), torch.tensor(cols)], [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_matches_autograd_for_the_tensor_and_the_values_written(accumulate):
    """x[rows, cols] = v (or += v), v broadcast along the positions; one position counted
    from the end."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 6)).astype("float32")
    v = rng.standard_normal((1,)).astype("float32")
    rows, cols = np.array([0, 4, 2, -1]), np.array([1, 5, 0, -2])
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(lambda a, b: relax.op.index_put(
        a, relax.Tuple([relax.const(rows), relax.const(cols)]), b, accumulate),
        [x.shape, v.shape], [x, v], w)
    want = torch_grads(lambda a, b: torch.index_put(
        a, (torch.tensor(rows), torch.tensor(cols)), b, accumulate), [x, v], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, **TOL)


def test_gather_nd_matches_autograd_with_repeated_and_negative_indices():
    """ONNX GatherND as an exported classifier uses it: (row, position) pairs, one repeated,
    one counted from the end."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 5, 4)).astype("float32")
    pairs = np.array([[0, 4], [2, 1], [2, 1], [1, -1]], "int64")
    w = rng.standard_normal((4, 4)).astype("float32")
    got = relax_grads(lambda a: relax.op.gather_nd(a, relax.const(pairs, "int64")), [x.shape], [x], w)
    want = torch_grads(lambda a: a[torch.tensor(pairs[:, 0]), torch.tensor(pairs[:, 1])], [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("keepdims", [True, False])
def test_max_and_min_share_the_gradient_among_ties_as_amax(reduce, keepdims):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, (4, 6)).astype("float32")  # many ties
    w = rng.standard_normal((4, 1) if keepdims else (4,)).astype("float32")
    op = getattr(relax.op, reduce)
    got = relax_grads(lambda a: op(a, axis=[1], keepdims=keepdims), [x.shape], [x], w)
    want = torch_grads(lambda a: getattr(torch, f"a{reduce}")(a, 1, keepdim=keepdims), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_tril_matches_autograd():
    rng = np.random.default_rng(6)
    x, w = (rng.standard_normal((2, 5, 5)).astype("float32") for _ in range(2))
    got = relax_grads(lambda a: relax.op.tril(a, 1), [x.shape], [x], w)
    want = torch_grads(lambda a: torch.tril(a, 1), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_index_and_mask_paths_stay_out_of_the_gradient():
    """A classifier reading each row's last non-pad token, as transformers' does: the position
    comes from integer ops on the input ids (no rule for argmax or arange), the mask from a
    comparison of the logits. Only the float path is differentiated, and the gradient is
    PyTorch's."""
    from pipelines.frontends.torch_program import translate
    from pipelines.training.graph import build_train_step
    from pipelines.training.optimizers import SGD

    class LastToken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 3)

        def forward(self, ids):
            logits = self.head(self.embed(ids))                    # (B, S, 3)
            last = (torch.arange(ids.shape[1]) * (ids != 0)).argmax(-1)
            keep = (logits > -1e9).to(logits.dtype)                # a mask from a comparison
            return (logits * keep)[torch.arange(ids.shape[0]), last]

    model = LastToken()
    ids = torch.tensor([[3, 4, 0, 0], [5, 6, 7, 0]])
    main, names, _ = translate(torch.export.export(model, (ids,)))
    assert rules.ops_without_gradient(main, main.params[1:]) == []
    step, signature = build_train_step(main, len(names), SGD(lr=1.0), {})
    mod = relax.transform.LegalizeOps()(tvm.IRModule({"train_step": step}))
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    labels = np.array([1, 2])
    params = [model.embed.weight, model.head.weight, model.head.bias]
    lr = tvm.runtime.tensor(np.array(1.0, "float32"))  # the optimizer's learning rate: state
    out = vm["train_step"](tvm.runtime.tensor(ids.numpy()), tvm.runtime.tensor(labels),
                           *[tvm.runtime.tensor(p.detach().numpy()) for p in params], lr)
    loss = torch.nn.functional.cross_entropy(model(ids), torch.tensor(labels))
    loss.backward()
    assert float(out[0].numpy()) == pytest.approx(loss.item(), rel=1e-5)
    for p, new in zip(params, list(out)[1:]):  # plain SGD, lr 1: new = p - grad
        np.testing.assert_allclose(new.numpy(), (p - p.grad).detach().numpy(), rtol=1e-5,
                                   atol=1e-6)


CONV = dict(rtol=1e-4, atol=1e-4)


def assert_conv_grads_match(relax_conv, torch_conv, x, k, w):
    """d/dx and d/dk of sum(conv(x, k) * w), Relax against autograd."""
    got = relax_grads(relax_conv, [x.shape, k.shape], [x, k], w)
    for g, t in zip(got, torch_grads(torch_conv, [x, k], w)):
        np.testing.assert_allclose(g, t, **CONV)


@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 1, 1, 1), (2, 2, 2, 2)])
def test_conv1d_matches_autograd(stride, padding, dilation, groups):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 4, 13)).astype("float32")
    k = rng.standard_normal((6, 4 // groups, 3)).astype("float32")
    want_y = torch.nn.functional.conv1d(torch.tensor(x), torch.tensor(k), stride=stride,
                                        padding=padding, dilation=dilation, groups=groups)
    w = rng.standard_normal(want_y.shape).astype("float32")
    assert_conv_grads_match(
        lambda a, b: relax.op.nn.conv1d(a, b, stride, padding, dilation, groups),
        lambda a, b: torch.nn.functional.conv1d(a, b, stride=stride, padding=padding,
                                                dilation=dilation, groups=groups), x, k, w)


@pytest.mark.parametrize("rank", [1, 2])
def test_transposed_conv_matches_autograd(rank):
    """Stride 2 with an output padding: the rows conv2d's stride never reads."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3) + (5,) * rank).astype("float32")
    k = rng.standard_normal((3, 4) + (3,) * rank).astype("float32")
    torch_op = getattr(torch.nn.functional, f"conv_transpose{rank}d")
    relax_op = getattr(relax.op.nn, f"conv{rank}d_transpose")
    want_y = torch_op(torch.tensor(x), torch.tensor(k), stride=2, padding=1, output_padding=1)
    w = rng.standard_normal(want_y.shape).astype("float32")
    assert_conv_grads_match(lambda a, b: relax_op(a, b, strides=2, padding=1, output_padding=1),
                            lambda a, b: torch_op(a, b, stride=2, padding=1, output_padding=1),
                            x, k, w)


def test_conv3d_matches_autograd():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 3, 6, 7, 5)).astype("float32")
    k = rng.standard_normal((4, 3, 3, 3, 2)).astype("float32")
    w = rng.standard_normal((2, 4, 3, 4, 3)).astype("float32")
    assert_conv_grads_match(lambda a, b: relax.op.nn.conv3d(a, b, strides=2, padding=1),
                            lambda a, b: torch.nn.functional.conv3d(a, b, stride=2, padding=1),
                            x, k, w)


def test_max_pool3d_sends_a_windows_gradient_to_its_first_maximum():
    """Ties (a window of equal values) get it at their first element, as PyTorch does."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 3, 4, 4, 6)).astype("float32")
    x[0, 0, :2, :2, :2] = 1.5
    w = rng.standard_normal((2, 3, 2, 2, 3)).astype("float32")
    got = relax_grads(lambda a: relax.op.nn.max_pool3d(a, 2, 2), [x.shape], [x], w)
    want = torch_grads(lambda a: torch.nn.functional.max_pool3d(a, 2), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("size,kernel,stride,padding,ceil,include_pad", [
    (8, 12, 12, 0, True, True),  # a window wider than the input (EfficientNet's pooler)
    (10, 3, 2, 1, True, True), (9, 4, 3, 1, True, True),  # the last window cut by ceil mode
    (9, 3, 2, 1, True, False), (10, 3, 2, 1, False, True)])
def test_avg_pool2d_divides_each_window_as_the_forward_does(size, kernel, stride, padding,
                                                            ceil, include_pad):
    """A window that ceil mode cuts past the padding is divided by its cut size, as PyTorch's
    (TVM's own rule divided it by the kernel's area)."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 3, size, size)).astype("float32")
    kwargs = dict(ceil_mode=ceil, count_include_pad=include_pad)
    want_y = torch.nn.functional.avg_pool2d(torch.from_numpy(x), kernel, stride, padding,
                                            **kwargs)
    w = rng.standard_normal(want_y.shape).astype("float32")
    got = relax_grads(lambda a: relax.op.nn.avg_pool2d(a, kernel, stride, padding, **kwargs),
                      [x.shape], [x], w)
    want = torch_grads(lambda a: torch.nn.functional.avg_pool2d(a, kernel, stride, padding,
                                                                **kwargs), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


@pytest.mark.parametrize("norm", ["group", "instance", "instance_over_the_batch"])
def test_group_and_instance_norm_match_autograd(norm):
    """Instance norm over axes [0, 2] of [1, C, K] is how TVM imports Bit's weight
    standardisation; batch norm's training mode computes the same."""
    rng = np.random.default_rng(15)
    shape = (1, 6, 15) if norm == "instance_over_the_batch" else (2, 6, 5, 3)
    x, g, b = (rng.standard_normal(s).astype("float32") for s in [shape, (6,), (6,)])
    w = rng.standard_normal(x.shape).astype("float32")
    make, reference = {
        "group": (lambda a, c, d: relax.op.nn.group_norm(a, c, d, 3, 1, [2, 3]),
                  lambda a, c, d: torch.nn.functional.group_norm(a, 3, c, d)),
        "instance": (lambda a, c, d: relax.op.nn.instance_norm(a, c, d, 1, [2, 3]),
                     lambda a, c, d: torch.nn.functional.instance_norm(a, weight=c, bias=d)),
        "instance_over_the_batch": (
            lambda a, c, d: relax.op.nn.instance_norm(a, c, d, 1, [0, 2]),
            lambda a, c, d: torch.nn.functional.batch_norm(a, None, None, c, d, training=True)),
    }[norm]
    got = relax_grads(make, [x.shape, g.shape, b.shape], [x, g, b], w)
    want = torch_grads(reference, [x, g, b], w)
    for got_one, want_one in zip(got, want):
        np.testing.assert_allclose(got_one, want_one, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("axes, begin, end, strides", [([2], [0], [100], [2]),
                                                       ([2], [1], [7], [3]),
                                                       ([0, 2], [1, 1], [3, 6], [1, 2])])
def test_strided_slice_with_strides_matches_autograd(axes, begin, end, strides):
    """Interleaved rotary embeddings read every other channel."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((3, 5, 7)).astype("float32")
    index = [slice(None)] * 3
    for a, b, e, s in zip(axes, begin, end, strides):
        index[a] = slice(b, e, s)
    w = rng.standard_normal(x[tuple(index)].shape).astype("float32")
    got = relax_grads(lambda a: relax.op.strided_slice(a, axes, begin, end, strides),
                      [x.shape], [x], w)
    want = torch_grads(lambda a: a[tuple(index)], [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)


def test_squeeze_topk_and_element_gather_scatter_match_autograd():
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, 1, 6)).astype("float32")
    w = rng.standard_normal((3, 6)).astype("float32")
    got = relax_grads(lambda a: relax.op.squeeze(a, [1]), [x.shape], [x], w)
    np.testing.assert_allclose(got[0], torch_grads(lambda a: a.squeeze(1), [x], w)[0], **TOL)

    x = rng.standard_normal((3, 6)).astype("float32")
    w = rng.standard_normal((3, 2)).astype("float32")
    got = relax_grads(lambda a: relax.TupleGetItem(relax.op.topk(a, 2, -1), 0),
                      [x.shape], [x], w)
    np.testing.assert_allclose(got[0], torch_grads(lambda a: a.topk(2, -1)[0], [x], w)[0],
                               **TOL)

    index = rng.integers(0, 6, (3, 4))  # repeats: their gradients add up
    w = rng.standard_normal((3, 4)).astype("float32")
    got = relax_grads(lambda a: relax.op.gather_elements(a, relax.const(index), 1),
                      [x.shape], [x], w)
    want = torch_grads(lambda a: torch.gather(a, 1, torch.tensor(index)), [x], w)
    np.testing.assert_allclose(got[0], want[0], **TOL)

    distinct = np.argsort(rng.random((3, 6)), 1)[:, :4]
    updates = rng.standard_normal((3, 4)).astype("float32")
    w = rng.standard_normal((3, 6)).astype("float32")
    for reduction, torch_op in [("update", "scatter"), ("add", "scatter_add")]:
        got = relax_grads(lambda a, u: relax.op.scatter_elements(
            a, relax.const(distinct), u, 1, reduction), [x.shape, updates.shape],
            [x, updates], w)
        want = torch_grads(lambda a, u: getattr(a, torch_op)(1, torch.tensor(distinct), u),
                           [x, updates], w)
        for g, t in zip(got, want):
            np.testing.assert_allclose(g, t, **TOL)


def test_slice_scatter_tile_and_flip_match_autograd():
    """A slice written over a tensor (linear attention's state), a tensor repeated (heads) and
    one reversed (a causal conv's windows)."""
    rng = np.random.default_rng(18)
    x = rng.standard_normal((3, 8, 2)).astype("float32")
    src = rng.standard_normal((3, 3, 2)).astype("float32")
    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(lambda a, s: relax.op.slice_scatter(a, s, 1, 7, 2, axis=1),
                      [x.shape, src.shape], [x, src], w)
    want = torch_grads(lambda a, s: torch.slice_scatter(a, s, 1, 1, 7, 2), [x, src], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, **TOL)

    for repeats in [(2, 1, 3), (2, 2, 1, 2)]:  # the second prepends an axis
        w = rng.standard_normal(np.tile(x, repeats).shape).astype("float32")
        got = relax_grads(lambda a: relax.op.tile(a, repeats), [x.shape], [x], w)
        want = torch_grads(lambda a: a.tile(repeats), [x], w)
        np.testing.assert_allclose(got[0], want[0], **TOL)

    w = rng.standard_normal(x.shape).astype("float32")
    got = relax_grads(lambda a: relax.op.flip(a, 1), [x.shape], [x], w)
    np.testing.assert_allclose(got[0], torch_grads(lambda a: a.flip(1), [x], w)[0], **TOL)


UNARY = [  # (relax op, PyTorch's, the inputs' range: inside each one's domain)
    (relax.op.acos, torch.acos, (-0.9, 0.9)), (relax.op.asin, torch.asin, (-0.9, 0.9)),
    (relax.op.atan, torch.atan, (-3, 3)), (relax.op.acosh, torch.acosh, (1.1, 4)),
    (relax.op.asinh, torch.asinh, (-3, 3)), (relax.op.atanh, torch.atanh, (-0.9, 0.9)),
    (relax.op.sinh, torch.sinh, (-3, 3)), (relax.op.cosh, torch.cosh, (-3, 3)),
    (relax.op.tan, torch.tan, (-1.2, 1.2)), (relax.op.square, torch.square, (-3, 3)),
    (lambda a: relax.op.nn.softplus(a, 2.0, 3.0),
     lambda a: torch.nn.functional.softplus(a, 2.0, 3.0), (-3, 3)),
    (lambda a: relax.op.nn.leakyrelu(a, 0.1),
     lambda a: torch.nn.functional.leaky_relu(a, 0.1), (-3, 3)),
    (relax.op.nn.selu, torch.selu, (-3, 3)),
    (relax.op.round, torch.round, (-3, 3)), (relax.op.floor, torch.floor, (-3, 3)),
    (relax.op.ceil, torch.ceil, (-3, 3)), (relax.op.trunc, torch.trunc, (-3, 3)),
    (relax.op.sign, torch.sign, (-3, 3))]


@pytest.mark.parametrize("op, reference, bounds", UNARY,
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else "")
def test_elementwise_rules_match_autograd(op, reference, bounds):
    rng = np.random.default_rng(11)
    x = rng.uniform(*bounds, (6, 7)).astype("float32")
    x[0, :3] = np.clip(0.0, *bounds)  # the activations' kink: PyTorch's side of it
    w = rng.standard_normal(x.shape).astype("float32")
    name = op(relax.Var("x", tensor_type(x.shape, "float32"))).op.name
    assert name not in rules.NO_RULE  # a rounding op's 0 is its rule's, not a missing rule's
    got = relax_grads(op, [x.shape], [x], w)
    np.testing.assert_allclose(got[0], torch_grads(reference, [x], w)[0], **TOL)


def test_stack_sends_each_operand_its_slice():
    rng = np.random.default_rng(12)
    a, b = (rng.standard_normal((3, 4)).astype("float32") for _ in range(2))
    w = rng.standard_normal((3, 2, 4)).astype("float32")
    got = relax_grads(lambda x, y: relax.op.stack([x, y], axis=1), [a.shape, b.shape], [a, b], w)
    want = torch_grads(lambda x, y: torch.stack([x, y], 1), [a, b], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, **TOL)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_maximum_and_minimum_share_the_gradient_among_ties_as_pytorch(reduction):
    """scatter_reduce's amax/amin: data's and the updates' values equal to the result share
    its gradient (one tie is forced between the data and an update, one among updates)."""
    rng = np.random.default_rng(13)
    data = rng.standard_normal((3, 4)).astype("float32")
    updates = rng.standard_normal((5, 4)).astype("float32")
    index = rng.integers(0, 3, (5, 4))
    index[:2, 0] = 1
    updates[1, 0] = updates[0, 0] = data[1, 0] = 9.0 if reduction == "max" else -9.0
    w = rng.standard_normal(data.shape).astype("float32")
    got = relax_grads(lambda d, u: relax.op.scatter_elements(
        d, relax.const(index), u, 0, reduction), [data.shape, updates.shape], [data, updates], w)
    want = torch_grads(lambda d, u: d.scatter_reduce(
        0, torch.from_numpy(index), u, "a" + reduction), [data, updates], w)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, **TOL)
