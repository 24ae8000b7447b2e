"""A saved torch.export program (.pt2) as a torch model's source (frontend torch, no entry;
pipelines/frontends/torch_module.py): compiled through the one chain (pipelines/compile.py), it
steps like PyTorch running the same program, and that program steps like the module it was
exported from.

The model: conv, batch norm (training mode: running statistics are buffers the step updates),
ReLU, a second conv, mean, linear; batch 4. Three chained SGD-momentum steps, full BP and a
sparse scheme (the head, norm shifts and half of a conv's output channels, by the program's own
parameter names). Tolerance: loss within 1e-4 relative at every step, every tensor of the state
within rtol 1e-4 / atol 1e-6, frozen parameters bit-identical (conftest.assert_steps_match).
"""
import numpy as np
import pytest
import torch
from conftest import assert_steps_match, model_section

from pipelines.compile import compile
from pipelines.config import SGD
from pipelines.schema import ConfigError
from pipelines.frontends.layers import describe_layers, describe_program
from pipelines.frontends import load_module
from pipelines.frontends.torch_module import load_program
from pipelines.models.pytorch import make_optimizer, seed_everything, train_step

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9)
BATCH = 4
FULL = [{"modules": ["*"]}]
SPARSE = [{"modules": ["head"]}, {"kinds": ["norm"], "update": "bias"},
          {"modules": ["conv2"], "channels": 0.5, "update": "weight"}]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 12, 1)
        self.head = torch.nn.Linear(12, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv1(x)))
        return self.head(self.conv2(x).mean((2, 3)))


def saved_program(directory) -> tuple:
    """A seeded Net exported in training mode and saved as a .pt2, with its model config."""
    seed_everything(0)
    net = Net().train()
    program = torch.export.export(net, (torch.zeros(BATCH, 3, 8, 8),))
    path = directory / "net.pt2"
    torch.export.save(program, path)
    return net, model_section(frontend="torch", source=str(path), batch_size=BATCH)


def batches(count=3):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, 3, 8, 8)).astype("float32"),
             rng.integers(0, 5, BATCH).astype("int64")) for _ in range(count)]


def test_program_layers_keep_its_names_and_kinds(tmp_path):
    net, model = saved_program(tmp_path)
    layers = describe_program(load_program(tmp_path / "net.pt2"))
    # The module objects are not saved; the kinds come from the graph's module stack.
    assert layers == describe_layers(net)
    assert [p["kind"] for p in layers["parameters"]] == [
        "conv", "conv", "norm", "norm", "conv_pointwise", "conv_pointwise", "linear", "linear"]


def test_program_module_trains_like_the_exported_module(tmp_path):
    net, model = saved_program(tmp_path)
    module, inputs = load_module(model)
    assert list(inputs) == ["x"] and inputs["x"].shape == (BATCH, 3, 8, 8)
    assert module.state_dict().keys() == net.state_dict().keys()
    assert module.train() is module
    with pytest.raises(ConfigError, match="no eval mode"):
        module.eval()
    a, b = make_optimizer(net, OPT), make_optimizer(module, OPT)
    for x, y in batches():
        assert train_step(module, b, x, y) == pytest.approx(train_step(net, a, x, y), rel=1e-6)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(module.state_dict()[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("rules", [FULL, SPARSE], ids=["full", "sparse"])
def test_compiled_program_steps_like_pytorch(tmp_path, host_profile, rules):
    net, model = saved_program(tmp_path)
    # a saved program's batch norms run as exported (training mode): its twin cannot hold them
    compiled = compile(model, rules, OPT, host_profile, tmp_path / "build", scheme_name="test",
                       statistics="every_layer")
    # Parameters and buffers keep the program's own names.
    assert sorted(compiled.signature["source_names"].values()) == sorted(
        k for k in net.state_dict() if not k.endswith("num_batches_tracked"))
    trainable = {compiled.signature["source_names"][p] for p in compiled.signature["trainable"]}
    if rules is SPARSE:
        assert trainable == {"head.weight", "head.bias", "norm.bias", "conv2.weight"}
        assert len(compiled.signature["channels"]) == 1
    before, after = assert_steps_match(compiled, model, OPT, batches(), rtol=1e-4)
    assert not torch.equal(before["head.weight"], after["head.weight"])


def test_a_programs_twin_cannot_hold_statistics_and_says_what_to_set(tmp_path):
    from pipelines.frontends.twin import torch_twin

    _, model = saved_program(tmp_path)
    with pytest.raises(ConfigError, match="cannot hold the statistics.*statistics: every_layer"):
        torch_twin(model, {"source_names": {}, "frozen_statistics": ["norm"]}, {})


@pytest.mark.parametrize("override, message", [
    ("+models.model.entry=build", "saved torch.export program: it takes no entry"),
    ("+models.model.kwargs={width:2}", "it takes no kwargs"),
])
def test_program_with_an_entry_is_refused_naming_the_key(override, message):
    from conftest import compose_params

    with pytest.raises(ConfigError, match=message) as err:
        compose_params("experiment=model", "model@models.model=pt2",
                       "models.model.source=net.pt2", override)
    assert "models.model (from conf/experiment)" in str(err.value)


def test_missing_or_bad_program_file_is_named(tmp_path):
    missing = model_section(frontend="torch", source=str(tmp_path / "gone.pt2"), batch_size=BATCH)
    with pytest.raises(ConfigError, match=r"gone.pt2: no such file \(models.<name>.source\)"):
        load_module(missing)
    (tmp_path / "bad.pt2").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"bad.pt2: not a program torch.export.save wrote"):
        load_module(missing.model_copy(update={"source": str(tmp_path / "bad.pt2")}))


def test_program_batch_must_match_the_config(tmp_path):
    from pipelines.frontends import import_model
    from pipelines.frontends.weights import FILE, initial_weights, save_weights

    _, model = saved_program(tmp_path)
    wrong = model.model_copy(update={"batch_size": 8})
    (tmp_path / "w").mkdir(), (tmp_path / "out").mkdir()
    save_weights(initial_weights(wrong, None, 0)[0], tmp_path / "w" / FILE)
    with pytest.raises(ConfigError, match=r"input x has batch 4; models.<name>.batch_size=8"):
        import_model(wrong, tmp_path / "w", tmp_path / "out")


def test_the_imported_program_holds_no_path_of_this_checkout(tmp_path):
    """The import stage's program is the same bytes in every clone: the stack traces
    torch.export records (this file's path, torch's) are left out."""
    from pipelines.frontends import import_model
    from pipelines.frontends.weights import FILE, initial_weights, save_weights

    _, model = saved_program(tmp_path)
    program = torch.export.load(tmp_path / "net.pt2")
    assert any("stack_trace" in node.meta for node in program.graph.nodes)  # torch keeps them
    (tmp_path / "w").mkdir(), (tmp_path / "out").mkdir()
    save_weights(initial_weights(model, None, 0)[0], tmp_path / "w" / FILE)
    import_model(model, tmp_path / "w", tmp_path / "out")
    imported = torch.export.load(tmp_path / "out" / "model.pt2")
    assert not [node.name for node in imported.graph.nodes if "stack_trace" in node.meta]
    assert __file__.encode() not in (tmp_path / "out" / "model.pt2").read_bytes()


class _WithEmptyFeatures(torch.nn.Module):
    """Concatenates an empty 1-D tensor (a multimodal model's image features when the batch has
    no image), which PyTorch skips whatever the other operands' rank."""

    def forward(self, x):
        return torch.cat([x.new_zeros(0), x * 2, x.new_zeros(0)], 1)


def _translated_forward(module: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    """``module``'s forward on ``x``, exported, translated and built by TVM."""
    import tvm
    from tvm import relax

    from pipelines.frontends.torch_program import translate

    main, _, _ = translate(torch.export.export(module, (x,)))
    vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main": main}), target="llvm"),
                              tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()))
    return (got[0] if not hasattr(got, "numpy") else got).numpy()


def test_a_concatenated_empty_1d_tensor_is_skipped_as_in_pytorch():
    x = torch.randn(2, 3, 4)
    np.testing.assert_array_equal(_translated_forward(_WithEmptyFeatures(), x),
                                  _WithEmptyFeatures()(x).numpy())


class _Spectrum(torch.nn.Module):
    def forward(self, x):
        return torch.fft.fft(x).abs()


def test_a_complex_value_read_by_an_unconverted_op_is_refused_by_name():
    """A complex tensor is held as (real, imaginary) pairs, which only the Fourier transforms,
    conj and view_as_real read: ``abs`` of one would read the pairs as reals, so it stops."""
    from pipelines.frontends.torch_program import translate

    program = torch.export.export(_Spectrum(), (torch.randn(2, 4),))
    with pytest.raises(NotImplementedError, match=r"reads the complex tensor .*only "
                                                  r"_fft_c2c.default, _conj.default"):
        translate(program)


class _Selecting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return h[h[:, 0] > 0].sum()


def test_a_boolean_mask_selection_is_refused_by_name():
    """x[mask] holds as many rows as the data decides; TVM's conversion stopped on a
    ``take`` of booleans."""
    from pipelines.frontends.torch_program import translate

    program = torch.export.export(_Selecting(), (torch.randn(3, 4),))
    with pytest.raises(ConfigError, match=r"<model> \(_Selecting\) indexes a tensor with a "
                                          r"boolean mask"):
        translate(program)


class _MaskedWrites(torch.nn.Module):
    def forward(self, x):
        rows, cells, added = x.clone(), x.clone(), x.clone()
        rows[x[..., 0] > 0] = torch.arange(4.0)  # a row every selected position shares
        cells[x > 1] = -2.0
        added.index_put_((x[..., 1] > 0,), torch.ones(4), accumulate=True)
        return rows + cells + added


def test_a_boolean_mask_write_of_a_shared_value_is_a_where():
    """x[mask] = v where every selected element shares v (T5Gemma 2's) keeps its shape;
    TVM's conversion stopped on an index_put of booleans."""
    x = torch.randn(2, 3, 4)
    np.testing.assert_allclose(_translated_forward(_MaskedWrites(), x),
                               _MaskedWrites()(x).numpy(), rtol=1e-6)


class _CountedAdapter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        out, keep = x.clone(), x[:, 0] > 0
        rows = x[keep]
        out[keep] = self.proj(rows) * rows.shape[0]  # scaled by the selected count
        return out


def test_a_masked_write_that_reads_its_row_count_stays_refused():
    """out[mask] = f(x[mask]) becomes where(mask, f(x), out) only while f maps each row
    alone: scaled by the number of selected rows, the rewrite would count every row."""
    from pipelines.frontends.torch_module import export
    from pipelines.frontends.torch_program import translate

    program = export(_CountedAdapter(), {"x": torch.randn(6, 4)})
    with pytest.raises(ConfigError, match=r"<model> \(_CountedAdapter\) indexes a tensor "
                                          r"with a boolean mask"):
        translate(program)


class _Clipping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.proj.weight.data.clamp_(-0.1, 0.1)  # weights clipped as Gemma 3n's AltUp does
        return self.proj(x).sum()


def test_a_write_in_forward_the_trace_cannot_follow_is_refused_by_line():
    """weight.data.clamp_ in forward: torch.export clamps a detached copy, so the compiled
    forward would read the weight unclipped (PyTorch's reads it clipped); torch's own error
    named no line."""
    from pipelines.frontends.torch_module import export

    with pytest.raises(ConfigError, match=r"<model> \(_Clipping\) writes in forward to a "
                                          r"tensor .*aten.clamp_.default at "
                                          r"test_torch_program.py:\d+: self.proj.weight.data"):
        export(_Clipping(), {"x": torch.randn(2, 4)})


class _DataDecided(torch.nn.Module):
    def __init__(self, split: bool):
        super().__init__()
        self.proj, self.split = torch.nn.Linear(4, 4), split

    def forward(self, x):
        h = self.proj(x)
        if self.split:  # rows per group counted from the data, as JetMoE's experts take them
            groups = torch.zeros(x.shape[0], 2).scatter(1, (x[:, :1] > 0).long(), 1.0)
            first, second = h.split(groups.long().sum(0).tolist())
            return first.sum() - second.sum()
        if h.sum() > 0:  # an if on a value
            return h.sum()
        return -h.sum()


def test_shapes_or_branches_the_data_decides_are_refused_by_name():
    """A size read from the data (a split by counts) or a Python if on a tensor's value
    has no static graph: the error names the layer, or the line that branches."""
    from pipelines.frontends.torch_module import export
    from pipelines.frontends.torch_program import translate

    x = torch.randn(6, 4)
    with pytest.raises(ConfigError, match=r"_DataDecided branches on a tensor's values "
                                          r"\(.*test_torch_program.py:\d+: if h.sum\(\) > 0:"):
        export(_DataDecided(split=False), {"x": x})
    program = torch.export.export(_DataDecided(split=True), (x,))
    with pytest.raises(ConfigError, match=r"<model> \(_DataDecided\) makes a tensor whose "
                                          r"size the data decides \(aten.split_with_sizes"):
        translate(program)


class _Dropping(torch.nn.Module):
    def __init__(self, rate: float, attend: float = 0.0, noise: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(rate)
        self.attend, self.noise = attend, noise

    def forward(self, x):
        torch.nn.Linear(4, 4)  # a layer built in forward, initialised at random, unread
        h = self.drop(self.proj(x))[:, None, None]
        if self.noise:
            h = h + torch.empty_like(h).uniform_()  # a fill in place that is read
        return torch.nn.functional.scaled_dot_product_attention(h, h, h, dropout_p=self.attend)


def test_a_layer_drawing_random_numbers_in_training_is_refused_by_name():
    """Dropout above 0 in training mode: a compiled step is deterministic, and TVM's
    conversion (the identity) would train another model than PyTorch trains."""
    from pipelines.frontends.torch_module import export

    export(_Dropping(0.0), {"x": torch.randn(2, 4)})  # off: nothing drawn is read
    with pytest.raises(ConfigError, match=r"<model> \(_Dropping\) draws random numbers in "
                                          r"training mode \(aten.uniform\)"):
        export(_Dropping(0.0, noise=True), {"x": torch.randn(2, 4)})
    with pytest.raises(ConfigError, match=r"drop \(Dropout\) draws random numbers in "
                                          r"training mode \(aten.dropout, p=0.5\)"):
        export(_Dropping(0.5), {"x": torch.randn(2, 4)})
    with pytest.raises(ConfigError, match=r"aten.scaled_dot_product_attention, p=0.1"):
        export(_Dropping(0.0, attend=0.1), {"x": torch.randn(2, 4)})  # attention's dropout


class _RoundedStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Cubed(torch.autograd.Function):
    """A backward written out by hand that is its forward's gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class _Quantised(torch.nn.Module):
    def __init__(self, function=None):
        super().__init__()
        self.function = function
        self.norm, self.proj = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)

    def forward(self, x):
        torch._check((x != 0).sum().item() <= x.numel())  # a value read: no fake forward
        h = self.norm(x)
        h = self.function.apply(h) if self.function else h + (h.round() - h).detach()
        return self.proj(h)


def test_a_custom_backward_that_is_not_its_forwards_gradient_is_refused_by_name():
    """torch.export keeps an autograd.Function's forward only: compiled, the straight-through
    estimator would pass round's gradient (0), not its own backward's; one whose backward is
    its forward's gradient exports. The model reads a value, so the check runs it on its
    weights: its running statistics stay as they were."""
    from pipelines.frontends.torch_module import export

    export(_Quantised(), {"x": torch.randn(2, 4)})  # the same, with detach
    export(_Quantised(_Cubed), {"x": torch.randn(2, 4)})
    module = _Quantised(_RoundedStraightThrough)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ConfigError, match=r"_Quantised computes \['test_torch_program\."
                                          r"_RoundedStraightThrough'\]: a torch.autograd.*"
                                          r"gradient of norm.weight is 1 of its scale off"):
        export(module, {"x": torch.randn(2, 4)})
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
