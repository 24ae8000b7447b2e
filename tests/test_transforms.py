"""Each pass of pipelines/transform/ on a small step, for what its docstring's Before/After says:
the structural change, the signature it leaves, and (run on TVM's VM, unfused) the same values
as the step before it, within float32 rounding (rtol 1e-5, atol 1e-6) or exactly where the
pass only drops work.

The model is a small MLP with a LayerNorm and a GELU (elementwise and norm activations a
backward pass reads, so recomputation has something to recompute). The fused loss and the gemm
isolation are checked against PyTorch in tests/test_loss.py and tests/test_backends.py.
"""
import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from pydantic import TypeAdapter
from tvm import relax
from tvm.script import tirx as T

from pipelines.analysis.cost import count_ops
from pipelines.analysis.liveness import classify, saved_for_backward, update_owners
from pipelines.compile import training_graph
from pipelines.config import Optimizer
from pipelines.frontends.torch_program import translate
from pipelines.ir import signature_of, without_signature
from pipelines.phases import Lowered
from pipelines.transform import (BoolOpsAsInts, CollapseReshapes, EmptyConstantsAsZeros,
                                 FlattenTakeIndices,
                                 FoldConstantReshapes, FreezeStatistics, FrozenNormsElementwise,
                                 MaxPoolGradInBounds, NonFiniteFills, PlainPowers,
                                 PruneFrozenUpdates, RecomputeActivations, ReorderUpdates,
                                 SliceChannelUpdates, SplitAsSlices, StoreFrozenWeights)
from pipelines.transform.freeze_statistics import norm_scales
from pipelines.transform.update_in_place import writes_safely_over

SGD = TypeAdapter(Optimizer).validate_python({"kind": "sgd", "lr": 0.1, "momentum": 0.9})


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


@pytest.fixture(scope="module")
def full():
    """The full step: every parameter updated."""
    torch.manual_seed(0)
    main, names, origins = translate(torch.export.export(MLP(), (torch.zeros(8, 12),)))
    return training_graph(Lowered(main, names, origins, values={}, layers={}), SGD).module


@pytest.fixture(scope="module")
def every(full):
    """The full step as the sparse phase leaves it for full BP (its signature lists what is
    trainable, which the optimize passes read)."""
    return PruneFrozenUpdates(set(signature_of(full)["source_names"]))(full)


def run(mod: tvm.IRModule, func: str = "train_step", args=None):
    """``func`` of ``mod`` on TVM's VM (legalized, unfused), on seeded arguments of its
    parameters' shapes; the outputs by position."""
    params = mod[func].params
    if args is None:
        rng = np.random.default_rng(0)
        args = []
        for p in params:
            shape, dtype = [int(d) for d in p.ty.shape], str(p.ty.dtype)
            args.append(rng.integers(0, 5, shape).astype(dtype) if "int" in dtype
                        else (rng.standard_normal(shape) * 0.3).astype(dtype))
    # Normalize first, as the optimize phase's later passes do (pipelines/compile.py)
    legal = tvm.transform.Sequential([relax.transform.Normalize(), relax.transform.LegalizeOps()])(
        tvm.IRModule({func: mod[func]}))
    vm = relax.VirtualMachine(relax.build(legal, target="llvm"), tvm.cpu())
    out = vm[func](*[tvm.runtime.tensor(a) for a in args])
    outs = list(out) if not hasattr(out, "numpy") else [out]
    return args, [o.numpy() for o in outs]


def outputs_by_name(mod, values):
    return dict(zip(signature_of(mod)["outputs"], values))


def test_prune_frozen_updates_drops_frozen_outputs_and_their_backward(full):
    sig = signature_of(full)
    keep = {n for n, s in sig["source_names"].items() if s.startswith("fc2.")}
    pruned = PruneFrozenUpdates(keep)(full)
    new = signature_of(pruned)
    assert set(new["trainable"]) == keep
    # loss, new weights, new momenta, the learning rate
    assert len(new["outputs"]) == 1 + 2 * len(keep) + 1
    assert not any(n.startswith("m_") and "fc1" in n for n in new["inputs"])
    # the backward through fc1 and the norm is dead: fewer matmuls, no norm gradient
    assert count_ops(pruned["train_step"]).get("relax.matmul", 0) < count_ops(
        full["train_step"]).get("relax.matmul", 0)
    # same loss and same kept updates, bit for bit (the pass only drops work)
    args, want = run(full)
    kept = [i for i, name in enumerate(sig["inputs"]) if name in new["inputs"]]
    _, got = run(pruned, args=[args[i] for i in kept])
    want, got = outputs_by_name(full, want), outputs_by_name(pruned, got)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_store_frozen_weights_halves_them_and_steps_as_float32_on_their_rounded_values(full,
                                                                                       dtype):
    """With fc2 trained, fc1 and the norm frozen: their weights and biases become inputs of
    ``dtype``, each widened before its reader; the step gives exactly what the float32 step
    gives on the same values rounded to ``dtype``, and the trained ones are left as they were."""
    from pipelines.compile import plan
    from pipelines.stored_weights import STORED_AS, as_stored

    sig = signature_of(full)
    pruned = PruneFrozenUpdates({n for n, s in sig["source_names"].items()
                                 if s.startswith("fc2.")})(full)
    stored = StoreFrozenWeights(dtype)(pruned)
    frozen = {n for n, s in sig["source_names"].items() if s.startswith(("fc1.", "norm."))}
    assert signature_of(stored)[STORED_AS] == dict.fromkeys(sorted(frozen), dtype)
    dtypes = {p.name: str(p.ty.dtype) for p in stored["train_step"].params}
    assert {n for n, d in dtypes.items() if d == dtype} == frozen
    assert count_ops(stored["train_step"])["relax.astype"] >= len(frozen)
    assert StoreFrozenWeights("float32")(pruned).same_as(pruned)
    weights = sum(int(np.prod([int(d) for d in p.ty.shape])) for p in pruned["train_step"].params
                  if p.name in frozen)
    assert plan(pruned)["inputs_bytes"] - plan(stored)["inputs_bytes"] == 2 * weights
    args, _ = run(pruned)
    names = signature_of(pruned)["inputs"]
    rounded = as_stored(signature_of(stored), dict(zip(names, args)))
    _, want = run(pruned, args=[np.asarray(rounded[n], "float32") if n in frozen else rounded[n]
                                for n in names])
    _, got = run(stored, args=[rounded[n] for n in names])
    for name, a, b in zip(signature_of(pruned)["outputs"], got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    with pytest.raises(ValueError, match="allowed"):
        StoreFrozenWeights("int4")


def test_store_frozen_weights_as_int8_keeps_a_scale_per_row_and_steps_as_float32_on_them(full):
    """int8: fc1's frozen weight (2-D) becomes int8 beside an input of its rows' float32
    scales, a quarter of its bytes; its 1-D bias and the norm stay float32. The step gives what
    the float32 step gives on the dequantized weight, to float32 rounding (the scale multiplies
    the product's columns, not the weight), and the trained fc2 as before."""
    from pipelines.compile import plan
    from pipelines.stored_weights import SCALES, STORED_AS, as_read, as_stored, scale_name

    sig = signature_of(full)
    pruned = PruneFrozenUpdates({n for n, s in sig["source_names"].items()
                                 if s.startswith("fc2.")})(full)
    stored = StoreFrozenWeights("int8")(pruned)
    w1 = next(n for n, s in sig["source_names"].items() if s == "fc1.weight")
    new = signature_of(stored)
    assert new[STORED_AS] == {w1: "int8"} and new[SCALES] == {w1: scale_name(w1)}
    assert new["inputs"] == signature_of(pruned)["inputs"] + [scale_name(w1)]
    params = {p.name: p.ty for p in stored["train_step"].params}
    rows, columns = (int(d) for d in params[w1].shape)
    assert str(params[w1].dtype) == "int8"
    assert [int(d) for d in params[scale_name(w1)].shape] == [rows]
    saved = 4 * rows * columns - (rows * columns + 4 * rows)
    assert plan(pruned)["inputs_bytes"] - plan(stored)["inputs_bytes"] == saved
    args, _ = run(pruned)
    names = signature_of(pruned)["inputs"]
    values = dict(zip(names, args))
    quantized = as_stored(new, values)
    assert quantized[w1].dtype == np.int8 and np.abs(quantized[w1]).max() == 127
    read = as_read(new, values)
    assert 0 < np.abs(read[w1] - values[w1]).max() <= quantized[scale_name(w1)].max() / 2 + 1e-7
    _, want = run(pruned, args=[read[n] for n in names])
    _, got = run(stored, args=[quantized[n] for n in new["inputs"]])
    for name, a, b in zip(signature_of(pruned)["outputs"], got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_slice_channel_updates_computes_only_the_selected_slice(full):
    sig = signature_of(full)
    w2 = next(n for n, s in sig["source_names"].items() if s == "fc2.weight")
    step = PruneFrozenUpdates({w2})(full)
    sliced = SliceChannelUpdates({w2: {"axis": 0, "index": [0, 3]}})(step)
    channels = signature_of(sliced)["channels"]
    assert channels[w2]["gradient"] == "operands" and channels[w2]["index"] == [0, 3]
    args, want = run(step)
    # the sliced step takes the selected rows' momentum only
    by_name = dict(zip(signature_of(step)["inputs"], args))
    sliced_args = [by_name[p.name] if [int(d) for d in p.ty.shape] == list(
        by_name[p.name].shape) else by_name[p.name][[0, 3]]
                   for p in sliced["train_step"].params]
    _, got = run(sliced, args=sliced_args)
    want, got = outputs_by_name(step, want), outputs_by_name(sliced, got)
    np.testing.assert_allclose(got[sig["outputs"][0]], want[sig["outputs"][0]], rtol=1e-6)
    new_w2 = next(n for n in got if n != sig["outputs"][0] and "m_" not in n)
    selected = got[new_w2] if got[new_w2].shape[0] == 2 else got[new_w2][[0, 3]]
    np.testing.assert_allclose(selected, want[new_w2][[0, 3]], rtol=1e-5, atol=1e-6)
    if got[new_w2].shape[0] != 2:  # a whole tensor: the other rows keep their values
        w2_value = args[sig["inputs"].index(w2)]
        np.testing.assert_array_equal(got[new_w2][[1, 2, 4]], w2_value[[1, 2, 4]])


def mean_update_position(mod) -> float:
    """Where the updates sit in the step, on average (0: first binding, 1: last)."""
    func = mod["train_step"]
    kinds = classify(func, update_owners(signature_of(mod)))
    bindings = func.body.blocks[0].bindings
    found = [i for i, b in enumerate(bindings) if kinds[b.var] == "update"]
    return sum(found) / len(found) / len(bindings)


def test_reorder_updates_moves_updates_up_with_the_same_values(every):
    full = every
    reordered = ReorderUpdates()(full)
    assert mean_update_position(reordered) < mean_update_position(full) - 0.05
    assert signature_of(reordered) == signature_of(full)
    args, want = run(full)
    _, got = run(reordered, args=args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_recompute_activations_keeps_less_with_the_same_values(every):
    full = every
    recomputed = RecomputeActivations()(full)
    owners = update_owners(signature_of(full))
    assert saved_for_backward(recomputed["train_step"], owners) < saved_for_backward(
        full["train_step"], owners)
    args, want = run(full)
    _, got = run(recomputed, args=args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_plain_powers_become_multiplies():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 6], "float32"))
    dy = relax.Var("dy", relax.TensorType([4, 6], "float32"))
    with bb.function("main", [x, dy]):
        with bb.dataflow():
            sq = bb.emit(relax.op.power(x, relax.const(2.0, "float32")))
            g = bb.emit(relax.op.multiply(dy, relax.op.power(x, relax.const(1.0, "float32"))))
            out = bb.emit_output(relax.Tuple([sq, g]))
        bb.emit_func_output(out)
    before = bb.get()
    after = PlainPowers()(before)
    assert "relax.power" in count_ops(before["main"])
    assert "relax.power" not in count_ops(after["main"])
    args, want = run(before, "main")
    _, got = run(after, "main", args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_non_finite_fills_become_broadcasts_that_legalize():
    """TVM's legalization of full(-inf) fails ("PrimType is not iterable"); the broadcast of
    the constant is the same tensor, and a finite fill is left as it is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            low = bb.emit(relax.op.full_like(x, relax.const(float("-inf"), "float32")))
            zero = bb.emit(relax.op.full(relax.ShapeExpr([2, 3]), relax.const(0.0, "float32")))
            out = bb.emit_output(relax.op.maximum(relax.op.maximum(low, x), zero))
        bb.emit_func_output(out)
    before = bb.get()
    after = NonFiniteFills()(before)
    assert "relax.full_like" in count_ops(before["main"])
    assert "relax.full_like" not in count_ops(after["main"])
    assert "relax.full" in count_ops(after["main"])  # the zeros stay
    with pytest.raises(TypeError, match="PrimType"):
        tvm.compile(before, target="llvm")
    x = np.array([[-1.0, 2.0, 0.5], [3.0, -4.0, 0.0]], "float32")
    _, got = run(after, "main", [x])
    np.testing.assert_array_equal(got[0], np.maximum(x, 0))


def test_flatten_take_indices_looks_up_by_1d_indices():
    bb = relax.BlockBuilder()
    tokens = relax.Var("tokens", relax.TensorType([2, 8], "int64"))
    w = relax.Var("w", relax.TensorType([64, 32], "float32"))
    with bb.function("main", [tokens, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.take(w, tokens, axis=0))
        bb.emit_func_output(out)
    before = bb.get()
    after = FlattenTakeIndices()(before)
    takes = [b.value for b in after["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.take"]
    assert len(takes) == 1 and len(takes[0].args[1].ty.shape) == 1
    rng = np.random.default_rng(1)
    args = [rng.integers(0, 64, (2, 8)).astype("int64"),
            rng.standard_normal((64, 32)).astype("float32")]
    _, want = run(before, "main", args)
    _, got = run(after, "main", args)
    np.testing.assert_array_equal(got[0], want[0])


def test_bool_ops_as_ints_compares_and_sums_masks_on_int_casts():
    bb = relax.BlockBuilder()
    m = relax.Var("m", relax.TensorType([4, 16], "bool"))
    with bb.function("main", [m]):
        with bb.dataflow():
            running = bb.emit(relax.op.cumsum(m, axis=-1))
            same = bb.emit(relax.op.equal(relax.op.expand_dims(running, [2]),
                                          relax.op.expand_dims(m, [1])))
            out = bb.emit_output(relax.op.not_equal(same, relax.op.expand_dims(m, [2])))
        bb.emit_func_output(out)
    before = bb.get()
    after = BoolOpsAsInts()(before)
    calls = [b.value for b in after["main"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call)]
    touched = [c for c in calls if c.op.name in ("relax.equal", "relax.not_equal",
                                                 "relax.cumsum")]
    assert len(touched) == 3 and all(str(c.args[0].ty.dtype) != "bool" for c in touched)
    mask = np.random.default_rng(2).integers(0, 2, (4, 16)).astype("bool")
    mask[0] = False  # a row that never turns on
    _, got = run(after, "main", [mask])
    # numpy: a bool cumsum is True from the first True on
    running = np.cumsum(mask, axis=-1) > 0
    want = (running[:, :, None] == mask[:, None, :]) != mask[:, :, None]
    np.testing.assert_array_equal(got[0], want)
    # TVM's code generator on the bool ops as they are (why the pass exists)
    with pytest.raises(tvm.error.InternalError, match="kDLFloat|fcmp"):
        run(before, "main", [mask])


def _one_op(make, shape=(2, 8)):
    """A module whose ``main(x)`` returns ``make(x)``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(make(x))
        bb.emit_func_output(out)
    return bb.get()


def test_split_as_slices_gives_empty_sections_that_build():
    before = _one_op(lambda x: relax.op.split(x, [0, 3, 3], axis=1))
    after = SplitAsSlices()(before)
    (x,), got = run(after, "main")
    want = np.split(x, [0, 3, 3], axis=1)
    assert [g.shape for g in got] == [(2, 0), (2, 3), (2, 0), (2, 5)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(tvm.error.InternalError, match="split_indices must be sorted"):
        run(before, "main")  # why the pass exists
    untouched = _one_op(lambda x: relax.op.split(x, [2, 5], axis=1))
    assert tvm_ffi.structural_equal(SplitAsSlices()(untouched), untouched)


def test_reshapes_of_constants_fold_as_fold_constant_folds_them():
    """StableHLO's scalars (a constant reshaped, broadcast, given an axis), folded by copying:
    FoldConstant, which builds a kernel for each, then makes the same module of them; the
    reshape of a variable stays."""
    scale = relax.const(np.float32(0.5))

    def scaled(x):
        ones = relax.op.expand_dims(relax.op.reshape(scale, [1, 1]), [0])
        return relax.op.multiply(relax.op.reshape(x, [1, 2, 8]),
                                 relax.op.broadcast_to(ones, [1, 2, 8]))

    before = _one_op(scaled)
    after = FoldConstantReshapes()(before)
    assert count_ops(after["main"]) == {"relax.reshape": 1, "relax.multiply": 1}
    fold = relax.transform.FoldConstant()  # as compile.py runs it, after this pass
    assert tvm_ffi.structural_equal(fold(after), fold(before))
    args, want = run(before, "main")
    np.testing.assert_array_equal(run(after, "main", args)[1], want)


def _reshaped(*shapes, inner_read_again=False):
    """``train_step(x)``: x [6, 4] reshaped to each of ``shapes`` in turn; with
    ``inner_read_again`` the first reshape is also an output."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([6, 4], "float32"))
    with bb.function("train_step", [x]):
        with bb.dataflow():
            values = [x]
            for shape in shapes:
                values.append(bb.emit(relax.op.reshape(values[-1], shape)))
            out = bb.emit_output(relax.Tuple([values[-1], values[1]]) if inner_read_again
                                 else values[-1])
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shapes, left", [([[2, 3, 4], [6, 4]], {}),
                                          ([[2, 12], [3, 8]], {"relax.reshape": 1}),
                                          ([[24], [2, 12], [4, 6]], {"relax.reshape": 1})])
def test_collapse_reshapes_leaves_one_reshape_or_none_with_the_same_values(shapes, left):
    before = _reshaped(*shapes)
    after = CollapseReshapes()(before)
    assert count_ops(after["train_step"]) == left
    args, want = run(before)
    np.testing.assert_array_equal(run(after, args=args)[1][0], want[0])


def test_collapse_reshapes_keeps_a_pair_whose_inner_reshape_is_read_again():
    """Collapsing it would move the outer reshape's readers to another tensor (docstring)."""
    before = _reshaped([2, 3, 4], [6, 4], inner_read_again=True)
    assert CollapseReshapes()(before).same_as(before)


def _reads_past_own_buffers(mod: tvm.IRModule) -> list[str]:
    """The blocks of ``mod``'s kernels that can read one of their kernel's own buffers (an
    argmax, not a parameter) outside it, over their variables' whole domains."""
    from tvm import s_tir
    from tvm.sym.analyzer import Analyzer

    past = []
    for gvar, func in mod.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        sch, analyzer = s_tir.Schedule(func), Analyzer()
        own = {b.name for b in sch.get(sch.get_sblock("root")).alloc_buffers}
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            stmt = sch.get(block)
            for iv in stmt.iter_vars:
                analyzer.bind(iv.var, iv.dom)
            for read in (r for r in stmt.reads if r.source.name in own):
                for span, extent in zip(read.region, read.source.shape):
                    bound = analyzer.const_int_bound(span.min)
                    if bound.min_value < 0 or \
                            bound.max_value + int(span.extent) > int(extent):
                        past.append(f"{gvar.name_hint}: {stmt.name_hint} reads "
                                    f"{read.source.name}")
    return past


@pytest.mark.parametrize("size, kernel, stride, padding, ceil, layout", [
    (16, 3, 2, 1, False, "NCHW"),  # ResNet's stem
    (15, 3, 2, 0, True, "NCHW"),  # ceil_mode: the last window reaches past the input
    (8, 2, 2, 0, False, "NHWC"),  # StableHLO's layout
    (9, 3, 1, 1, False, "NCHW"),
])
def test_max_pool_gradient_reads_in_bounds_and_is_pytorchs(size, kernel, stride, padding,
                                                           ceil, layout):
    """Max pooling's gradient, tied values included (the first of a window's maxima takes
    it), equal to PyTorch's, with no read outside the argmax; TVM's legalization reads past
    it at ResNet's stem."""
    torch.manual_seed(0)
    x = ((torch.randn(2, 3, size, size) * 4).round() / 4).requires_grad_(True)
    y = torch.nn.functional.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil)
    dy = torch.randn_like(y)
    y.backward(dy)
    args, want = [dy.numpy(), x.detach().numpy()], x.grad.numpy()
    if layout == "NHWC":
        args, want = [a.transpose(0, 2, 3, 1).copy() for a in args], want.transpose(0, 2, 3, 1)
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(list(a.shape), "float32"))
              for n, a in zip(["dy", "x"], args)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.max_pool2d_backward(
                *params, [kernel] * 2, [stride] * 2, [padding] * 4, [1, 1], ceil, False, layout))
        bb.emit_func_output(out)
    before = bb.get()
    after = MaxPoolGradInBounds()(before)
    assert "relax.grad.max_pool2d_backward" not in count_ops(after["main"])
    legal = relax.transform.LegalizeOps()(after)
    vm = relax.VirtualMachine(tvm.compile(legal, target="llvm"), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert _reads_past_own_buffers(legal) == []
    if (size, kernel, stride, padding) == (16, 3, 2, 1):  # why the pass exists
        assert _reads_past_own_buffers(relax.transform.LegalizeOps()(before))


def test_empty_constants_become_zeros_that_a_built_step_loads(tmp_path):
    empty = relax.const(np.zeros((2, 0), "float32"))
    before = _one_op(lambda x: relax.op.concat([x, empty], axis=1), shape=(2, 3))
    x = np.arange(6, dtype="float32").reshape(2, 3)
    for name, mod in [("after", EmptyConstantsAsZeros()(before)), ("before", before)]:
        relax.build(mod, target="llvm").export_library(str(tmp_path / f"{name}.so"))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / "after.so")), tvm.cpu())
    np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), x)
    with pytest.raises(tvm.error.InternalError, match="Invalid DLTensor file format"):
        tvm.runtime.load_module(str(tmp_path / "before.so"))  # why the pass exists


def test_freeze_statistics_normalises_frozen_layers_with_their_running_statistics():
    """Two batch norms exported in training mode, the first frozen: it computes what PyTorch's
    eval mode computes and returns its statistics as they came; the second still moves its."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                              torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4))
    for norm in (net[1], net[3]):  # statistics unlike a batch's
        norm.running_mean.uniform_(-1, 1), norm.running_var.uniform_(0.5, 2)
    main, names, _ = translate(torch.export.export(net.train(), (torch.zeros(2, 3, 5, 5),)))
    relax_of = {source: name for name, (_, source) in names.items()}
    assert norm_scales(main) == {relax_of["1.weight"], relax_of["3.weight"]}
    after = FreezeStatistics([relax_of["1.weight"]])(tvm.IRModule({"main": main}))
    x = torch.randn(2, 3, 5, 5)
    values = {name: net.state_dict()[source].numpy() for name, (_, source) in names.items()}
    _, got = run(after, "main", [values.get(p.name, x.numpy()) for p in main.params])
    outputs = dict(zip(["logits", *(p.name for p in main.params[-4:])], got))
    net[1].eval()
    with torch.no_grad():
        want = net(x)
    np.testing.assert_allclose(outputs["logits"], want.numpy(), rtol=1e-5, atol=1e-5)
    for stat in ("running_mean", "running_var"):
        held, moved = relax_of[f"1.{stat}"], relax_of[f"3.{stat}"]
        np.testing.assert_array_equal(outputs[held], values[held])
        np.testing.assert_allclose(outputs[moved], getattr(net[3], stat).numpy(), rtol=1e-5)


def test_a_frozen_batch_norm_becomes_arithmetic_fused_into_its_convolution():
    """The frozen (eval-mode) batch norm of two becomes elementwise arithmetic with the same
    results; fused, its convolution's kernel computes it (one kernel fewer); the training-mode
    one, which computes the batch's statistics, stays a batch norm."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4),
                              torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4))
    main, names, _ = translate(torch.export.export(net.train(), (torch.zeros(2, 3, 5, 5),)))
    relax_of = {source: name for name, (_, source) in names.items()}
    frozen = FreezeStatistics([relax_of["1.weight"]])(tvm.IRModule({"main": main}))
    after = FrozenNormsElementwise()(frozen)
    assert count_ops(frozen["main"])["relax.nn.batch_norm"] == 2
    assert count_ops(after["main"])["relax.nn.batch_norm"] == 1
    args, want = run(frozen, "main")
    _, got = run(after, "main", args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    def kernels(mod):
        fused = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
        return sum(isinstance(f, tvm.tirx.PrimFunc) for f in fused.functions.values())
    assert kernels(after) == kernels(frozen) - 1


def test_update_in_place_writes_every_update_over_its_state_with_the_same_values(every):
    """Fused as the optimize phase fuses it, the step with and without UpdateInPlace: the same
    results; the in-place one allocates no storage for any weight's or momentum's new value,
    and after a call the tensors passed in hold the new values."""
    from pipelines.compile import _optimized, plan

    fresh, in_place = (_optimized(every, True, False, flag, 0, "float32") for flag in (False, True))
    sig = signature_of(in_place)
    state = [n.removeprefix("new_") for n in sig["outputs"][1:] if n != "new_optimizer_lr"]
    assert sorted(sig["updated_in_place"]) == sorted(state)
    # the one new output: the loss (a float32 scalar)
    assert plan(in_place)["outputs_bytes"] == 4 < plan(fresh)["outputs_bytes"]
    assert plan(in_place)["liveness"]["at_peak"]["outputs"] <= 4
    rng = np.random.default_rng(0)
    args = [rng.integers(0, 5, [int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
            if "int" in str(p.ty.dtype) else
            (rng.standard_normal([int(d) for d in p.ty.shape]) * 0.3).astype(str(p.ty.dtype))
            for p in in_place["train_step"].params]
    results = {}
    for name, mod in (("fresh", fresh), ("in_place", in_place)):
        vm = relax.VirtualMachine(relax.build(without_signature(mod), target="llvm"), tvm.cpu())
        tensors = [tvm.runtime.tensor(a) for a in args]
        out = [o.numpy() for o in vm["train_step"](*tensors)]
        results[name] = dict(zip(sig["outputs"], out))
        passed = dict(zip(sig["inputs"], (t.numpy() for t in tensors)))
        for entry in state:  # fresh: the inputs untouched; in place: they hold the new values
            expect = results[name]["new_" + entry] if name == "in_place" else args[
                sig["inputs"].index(entry)]
            np.testing.assert_array_equal(passed[entry], expect, err_msg=f"{name} {entry}")
    for key, value in results["fresh"].items():
        np.testing.assert_allclose(results["in_place"][key], value, rtol=1e-6, atol=1e-7)


@tvm.script.ir_module
class Kernels:
    @T.prim_func(s_tir=True)
    def elementwise(g: T.Buffer((4, 8), "float32"), w: T.Buffer((4, 8), "float32"),
                    out: T.Buffer((4, 8), "float32")):
        for i, j in T.grid(4, 8):
            with T.sblock("update"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = w[vi, vj] - g[vi, vj]

    @T.prim_func(s_tir=True)
    def read_transposed(g: T.Buffer((8, 8), "float32"), w: T.Buffer((8, 8), "float32"),
                        out: T.Buffer((8, 8), "float32")):
        for i, j in T.grid(8, 8):
            with T.sblock("update"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = w[vj, vi] - g[vi, vj]

    @T.prim_func(s_tir=True)
    def read_after(g: T.Buffer((4, 8), "float32"), w: T.Buffer((4, 8), "float32"),
                   out: T.Buffer((4, 8), "float32"), twice: T.Buffer((4, 8), "float32")):
        for i, j in T.grid(4, 8):
            with T.sblock("update"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = w[vi, vj] - g[vi, vj]
        for i, j in T.grid(4, 8):
            with T.sblock("later"):
                vi, vj = T.axis.remap("SS", [i, j])
                twice[vi, vj] = w[vi, vj] * T.float32(2)


@pytest.mark.parametrize("kernel, safe", [("elementwise", True), ("read_transposed", False),
                                          ("read_after", False)])
def test_a_kernel_is_made_in_place_only_where_no_element_is_read_after_it_is_overwritten(
        kernel, safe):
    func = Kernels[kernel]
    assert writes_safely_over(func, func.params[1], func.params[2]) is safe
