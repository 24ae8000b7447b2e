"""Frontends (pipelines/frontends/): a model from another framework's file becomes the same kind
of training step, through the one chain (pipelines/compile.py: compile).

The same small CNN (conv, ReLU, max pool, conv, ReLU, mean, linear) with the same weights comes
in from each frontend; its compiled step must give PyTorch's loss and updated weights (two
chained steps: loss within 1e-5 relative, weights within rtol 1e-4, atol 1e-6). MobileNetV2
through ONNX (with training-mode batch norm) must select the same layers under a scheme and
step like PyTorch (each tensor's change within 2% of PyTorch's, as for any ReLU6 network). A
model file's import is deterministic (byte-identical files) and needs no PyTorch module. Bad
files and unsupported operators fail naming the file, op and node.
"""
import importlib.util
import io
import json

import numpy as np
import onnx
import pytest
import torch
from conftest import compose_params, model_section
from onnx import TensorProto, helper

from pipelines.compile import compile
from pipelines.config import SGD
from pipelines.schema import ConfigError
from pipelines.frontends import import_model, lower_model
from pipelines.frontends.layers import describe_layers, describe_onnx
from pipelines.frontends.onnx_graph import (
    check_supported,
    load_onnx,
    prepare,
    trainable,
    translate_onnx,
)
from pipelines.models.mobilenetv2 import MobileNetV2
from pipelines.models.pytorch import hold_statistics, make_optimizer, selection_of, train_step
from pipelines.runtime.step import CompiledStep
from pipelines.training.graph import MissingGradientRule, build_train_step
from pipelines.training.optimizers import from_config
from pipelines.training.scheme import select
from tests.frontends import cnn_jax

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
BATCH = 4
FULL = [{"name": "everything", "modules": ["*"], "update": "both"}]
KERAS = "Keras is an optional extra: pip install -e '.[keras]'"


class SmallCNN(torch.nn.Module):
    """tests/frontends/cnn_jax.py's model in PyTorch, with the same parameter names."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))


def shared_weights() -> dict[str, np.ndarray]:
    """The one set of weights every framework's CNN starts from, by parameter name."""
    return {f"{layer}.{role}": value for layer, roles in cnn_jax.init().items()
            for role, value in roles.items()}


def torch_cnn() -> SmallCNN:
    model = SmallCNN()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in shared_weights().items()})
    return model


def onnx_file(model: torch.nn.Module, example: torch.Tensor, path):
    """``model`` exported for inference (names kept), with a dynamic batch dimension as
    exporters usually leave it."""
    buffer = io.BytesIO()
    torch.onnx.export(model.eval(), (example,), buffer, dynamo=False, input_names=["x"],
                      output_names=["logits"], do_constant_folding=False,
                      dynamic_axes={"x": {0: "batch"}})
    path.write_bytes(buffer.getvalue())
    return path


def compile_file(model, profile, directory, rules=FULL):
    """A model file through every phase of the chain: (loaded step, what compile returned)."""
    compiled = compile(model, rules, OPT, profile, directory, scheme_name="test")
    return CompiledStep(compiled.directory, compiled.initial), compiled


def compile_onnx(path, profile, directory, batch=BATCH, rules=FULL, blocks=()):
    return compile_file(model_section(frontend="onnx", source=str(path), batch_size=batch,
                              blocks=list(blocks)), profile, directory, rules)


def compile_jax(profile, directory):
    """tests/frontends/cnn_jax.py as conf/model/jax.yaml names it (`experiment=model
    model@models.model=jax`), compiled."""
    pytest.importorskip("jax", reason="JAX is an optional extra: pip install -e '.[jax]'")
    params = compose_params("experiment=model", "model@models.model=jax",
                            f"models.model.batch_size={BATCH}")
    return compile_file(params.models["model"], profile, directory)


def compile_keras(profile, directory, model=None, rules=FULL):
    """A Keras model (tests/frontends/cnn_keras.py's by default) saved as a .keras file and
    compiled: (step, compiled, apply, params, buffers), the last three as the keras frontend
    reads the file (the function its step was lowered from)."""
    if importlib.util.find_spec("keras") is None:  # imported on its JAX backend below
        pytest.skip(KERAS)
    from pipelines.frontends.keras import load_keras_file
    from pipelines.frontends.stablehlo import parameter_kinds, stablehlo_text
    from tests.frontends import cnn_keras

    directory.mkdir(exist_ok=True)
    path = directory / "model.keras"
    (model or cnn_keras.build()).save(path)
    apply, params, example, buffers, kinds = load_keras_file(path, BATCH)
    # Kinds from Keras's layer classes; the ops that use them agree where they can tell.
    text, names, _ = stablehlo_text(apply, params, example, buffers)
    from_ops = parameter_kinds(text, names)
    assert all(from_ops[n] == k for n, k in kinds.items() if k != "norm"), (kinds, from_ops)
    step, compiled = compile_file(model_section(frontend="keras", source=str(path), batch_size=BATCH),
                                  profile, directory / "build", rules)
    return step, compiled, apply, params, buffers


def batches(count=2):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, *cnn_jax.IMAGE)).astype("float32"),
             rng.integers(0, 10, BATCH).astype("int64")) for _ in range(count)]


def jax_steps(apply, params, batches_, buffers=None, trainable=None
              ) -> list[tuple[float, dict[str, np.ndarray]]]:
    """The source framework's own gradients (jax.grad of the mean cross entropy of
    ``apply(params, x)``, or of ``apply(params, buffers, x)`` -> (logits, new buffers))
    driving torch.optim.SGD's update rule on the ``trainable`` parameter names (all if None):
    after each batch, the loss and the weights and buffers, by name."""
    import jax
    import jax.numpy as jnp

    from pipelines.frontends.stablehlo import parameter_names

    def loss(params, buffers, x, y):
        logits, new = apply(params, x) if buffers is None else apply(params, buffers, x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1)), new

    def state(params, buffers) -> dict[str, np.ndarray]:
        named = dict(zip(parameter_names(params),
                         (np.asarray(v) for v in jax.tree_util.tree_leaves(params))))
        if buffers:
            named.update(zip(parameter_names(buffers),
                             (np.asarray(v) for v in jax.tree_util.tree_leaves(buffers))))
        return named

    if buffers is None:
        plain = apply
        apply = lambda params, x: (plain(params, x), None)
    # compiled once rather than dispatched op by op (a MobileNetV2 step is hundreds of ops)
    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    momenta, steps = None, []
    for x, y in batches_:
        (value, new), grads = value_and_grad(params, buffers, x, y)
        buffers = new
        grads = jax.tree_util.tree_map(lambda g, w: np.asarray(g) + OPT.weight_decay * w,
                                       grads, params)
        momenta = grads if momenta is None else jax.tree_util.tree_map(
            lambda b, g: OPT.momentum * b + g, momenta, grads)
        stepped = jax.tree_util.tree_map(lambda w, b: w - OPT.lr * b, params, momenta)
        if trainable is None:
            params = stepped
        else:  # frozen parameters keep their values (their momenta are never read)
            names = parameter_names(params)
            leaves = [new if name in trainable else old for name, new, old in zip(
                names, jax.tree_util.tree_leaves(stepped), jax.tree_util.tree_leaves(params))]
            params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaves)
        steps.append((float(value), state(params, buffers)))
    return steps


def jax_reference(apply, params, batches_, buffers=None, trainable=None
                  ) -> tuple[list[float], dict[str, np.ndarray]]:
    """``jax_steps``' losses, and the weights and buffers after the last batch."""
    steps = jax_steps(apply, params, batches_, buffers, trainable)
    return [loss for loss, _ in steps], steps[-1][1]


def torch_reference(batches_) -> tuple[list[float], dict[str, np.ndarray]]:
    model = torch_cnn().train()
    optimizer = make_optimizer(model, OPT)
    losses = [train_step(model, optimizer, x, y) for x, y in batches_]
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


def run_compiled(step, batches_) -> tuple[list[float], dict[str, np.ndarray]]:
    losses = [step.step(x, y) for x, y in batches_]
    return losses, {k: v.numpy() for k, v in step.state_dict().items()}


def assert_same(got, want, label):
    (got_losses, got_weights), (want_losses, want_weights) = got, want
    assert got_losses == pytest.approx(want_losses, rel=1e-5), label
    assert set(got_weights) == set(want_weights), label
    for name, value in want_weights.items():
        np.testing.assert_allclose(got_weights[name], value, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{label}: {name}")


@pytest.mark.slow
def test_onnx_small_cnn_steps_like_pytorch(tmp_path, host_profile):
    path = onnx_file(torch_cnn(), torch.zeros(1, *cnn_jax.IMAGE), tmp_path / "cnn.onnx")
    step, _ = compile_onnx(path, host_profile, tmp_path / "build")
    # Initializers keep their PyTorch names: one scheme language for both paths.
    assert sorted(step.signature["source_names"].values()) == sorted(shared_weights())
    assert_same(run_compiled(step, batches()), torch_reference(batches()), "onnx vs PyTorch")


@pytest.mark.slow
def test_jax_small_cnn_steps_like_jax_and_like_the_other_frontends(tmp_path, host_profile):
    step, _ = compile_jax(host_profile, tmp_path / "jax")
    compiled = run_compiled(step, batches())
    assert_same(compiled, jax_reference(cnn_jax.apply, cnn_jax.init(), batches()),
                "jax vs jax.grad")
    # The same CNN and weights from PyTorch, and from its ONNX file: the same step.
    assert_same(compiled, torch_reference(batches()), "jax vs PyTorch")
    path = onnx_file(torch_cnn(), torch.zeros(1, *cnn_jax.IMAGE), tmp_path / "cnn.onnx")
    onnx_step, _ = compile_onnx(path, host_profile, tmp_path / "onnx")
    assert_same(compiled, run_compiled(onnx_step, batches()), "jax vs onnx")


@pytest.mark.slow
def test_keras_small_cnn_steps_like_the_other_frontends(tmp_path, host_profile):
    step, compiled, apply, params, buffers = compile_keras(host_profile, tmp_path / "keras")
    layers = compiled.layers
    # Keras's variable paths are the parameter names; kernels are weights, biases biases.
    assert [(p["name"], p["module"], p["kind"], p["role"]) for p in layers["parameters"]][:2] == [
        ("conv1/bias", "conv1", "conv", "bias"), ("conv1/kernel", "conv1", "conv", "weight")]
    nhwc = [(x.transpose(0, 2, 3, 1).copy(), y) for x, y in batches()]
    losses, weights = run_compiled(step, nhwc)
    # Keras's own gradients (jax.grad through its JAX backend's stateless_call).
    assert_same((losses, weights), jax_reference(apply, params, nhwc, buffers),
                "keras vs jax.grad")
    # Back in PyTorch's names and layouts: the same losses and weights as PyTorch's step.
    back = {}
    for name, value in weights.items():
        layer, leaf = name.split("/")
        torch_value = value.transpose(3, 2, 0, 1) if value.ndim == 4 else value.T
        back[f"{layer}.{'bias' if leaf == 'bias' else 'weight'}"] = torch_value
    assert_same((losses, back), torch_reference(batches()), "keras vs PyTorch")
    # A channel rule on a channels-last kernel is refused, not applied to the wrong axis.
    with pytest.raises(ConfigError, match="HWIO|keras layout"):
        select([{"name": "half", "modules": ["conv1"], "channels": 0.5}], layers)


def keras_mobilenetv2_net():
    """Keras, and keras.applications.MobileNetV2 at 32x32 and width 0.35, seeded random init;
    skips the test where Keras is not installed."""
    if importlib.util.find_spec("keras") is None:
        pytest.skip(KERAS)
    from pipelines.frontends.keras import load_keras

    keras = load_keras()
    keras.utils.set_random_seed(0)
    return keras, keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35,
                                                 weights=None, classes=10)


@pytest.fixture(scope="module")
def keras_mobilenetv2(tmp_path_factory):
    """keras.applications.MobileNetV2, random init at 32x32 and width 0.35, saved as a .keras
    file: its model section, its lowered form (one import for every scheme), and the function
    the keras frontend reads from the file (apply, params, buffers)."""
    from pipelines.compile import import_and_lower
    from pipelines.frontends.keras import load_keras_file

    _, net = keras_mobilenetv2_net()
    path = tmp_path_factory.mktemp("keras_mobilenetv2") / "model.keras"
    net.save(path)
    apply, params, _, buffers, _ = load_keras_file(path, BATCH)
    model = model_section(frontend="keras", source=str(path), batch_size=BATCH)
    return model, import_and_lower(model), apply, params, buffers


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_keras_mobilenetv2_steps_like_keras(tmp_path, host_profile, keras_mobilenetv2, scheme):
    """keras.applications.MobileNetV2 (ZeroPadding2D, depthwise convolutions, batch norm in
    training mode, ReLU6) against Keras's own gradients (jax.grad through its JAX backend)
    driving the same SGD update; full BP, and a sparse scheme in Keras's layer names (the head,
    the last two blocks' expand kernels).

    The first step: the loss rel 1e-5 and each tensor's change within 2% of Keras's (its norm;
    the tolerance of the PyTorch MobileNetV2 tests, tests/test_train_step.py: a ReLU6 input
    within an ulp of 0 or 6 passes or blocks its gradient on either side, and batch norm over 4
    images at 1x1 amplifies it), frozen parameters bit-identical after three steps. A wrong
    gradient is off by ~100%. Steps 2-3 drift apart by ~1% in the loss for that reason, so
    they are held to 3%."""
    model, lowered, apply, params, buffers = keras_mobilenetv2
    rules = FULL if scheme == "full" else [
        {"modules": ["predictions"]},
        {"modules": ["block_15_expand", "block_16_expand"], "update": "weight"}]
    compiled = compile(model, rules, OPT, host_profile, tmp_path, scheme_name="test",
                       lowered=lowered)
    step = CompiledStep(compiled.directory, compiled.initial)
    names = compiled.signature["source_names"]
    trainable = {names[p] for p in compiled.signature["trainable"]}
    if scheme == "sparse":
        assert trainable == {"predictions/kernel", "predictions/bias", "block_15_expand/kernel",
                             "block_16_expand/kernel"}
    rng = np.random.default_rng(0)
    nhwc = [(rng.standard_normal((BATCH, 32, 32, 3)).astype("float32"),
             rng.integers(0, 10, BATCH).astype("int64")) for _ in range(3)]
    initial = {k: v.numpy() for k, v in step.state_dict().items()}
    (loss,), after = run_compiled(step, nhwc[:1])
    keras_steps = jax_steps(apply, params, nhwc, buffers, trainable)
    want_loss, want = keras_steps[0]
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert set(after) == set(want)
    for name, value in want.items():
        change = value - initial[name]
        error = np.linalg.norm(after[name] - initial[name] - change)
        assert error <= 1e-6 * np.sqrt(change.size) + 0.02 * np.linalg.norm(change), name
    later = [step.step(x, y) for x, y in nhwc[1:]]
    assert later == pytest.approx([loss for loss, _ in keras_steps[1:]], rel=3e-2)
    for name, value in step.state_dict().items():
        if name not in trainable and name not in buffers_names(buffers):
            np.testing.assert_array_equal(value.numpy(), initial[name], err_msg=f"{name} frozen")


@pytest.mark.slow
def test_keras_mobilenetv2_with_frozen_batch_norms_steps_as_keras_to_1e_4(tmp_path,
                                                                         host_profile):
    """Fine-tuned as Keras's transfer-learning guide does it, its batch norms frozen
    (``trainable = False``: inference mode, with statistics drawn as a trained model's rather
    than 0 and 1): three SGD steps, every variable within 1e-4 of its scale of Keras's own
    (jax.grad), the losses rel 1e-5. Training-mode batch norm is held to 2% above: there
    Keras's own float32 step moves by up to 1% of a depthwise kernel when its weights move by
    8 ulps (docs/frontends.md); frozen, by 1e-6."""
    from pipelines.frontends.keras import load_keras_file

    keras, net = keras_mobilenetv2_net()
    rng = np.random.default_rng(0)
    for layer in net.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
            for variable, (low, high) in [(layer.gamma, (0.5, 1.5)), (layer.beta, (-0.3, 0.3)),
                                          (layer.moving_mean, (-0.3, 0.3)),
                                          (layer.moving_variance, (0.5, 1.5))]:
                variable.assign(rng.uniform(low, high, variable.shape).astype("float32"))
    path = tmp_path / "model.keras"
    net.save(path)
    apply, params, _, buffers, _ = load_keras_file(path, BATCH)
    model = model_section(frontend="keras", source=str(path), batch_size=BATCH)
    compiled = compile(model, FULL, OPT, host_profile, tmp_path / "build", scheme_name="test")
    step = CompiledStep(compiled.directory, compiled.initial)
    names = compiled.signature["source_names"]
    trainable = {names[p] for p in compiled.signature["trainable"]}
    assert not any(name.endswith(("gamma", "beta")) for name in trainable)
    nhwc = [(rng.standard_normal((BATCH, 32, 32, 3)).astype("float32"),
             rng.integers(0, 10, BATCH).astype("int64")) for _ in range(3)]
    initial = {k: v.numpy() for k, v in step.state_dict().items()}
    losses, after = run_compiled(step, nhwc)
    want_losses, want = jax_reference(apply, params, nhwc, buffers, trainable)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert set(after) == set(want)
    for name, value in want.items():
        assert np.abs(after[name] - value).max() <= 1e-4 * np.abs(value).max(), name
    moved = max(np.abs(want[n] - initial[n]).max() / np.abs(initial[n]).max()
                for n in trainable if n.endswith("kernel"))
    assert moved > 1e-2  # the steps move weights by far more than the tolerance


def buffers_names(buffers) -> set[str]:
    from pipelines.frontends.stablehlo import parameter_names

    return set(parameter_names(buffers)) if buffers else set()


@pytest.mark.slow
def test_keras_batch_norm_statistics_are_buffers_updated_as_keras_does(tmp_path, host_profile):
    """Keras's non-trainable variables (here batch-norm moving statistics) are the step's
    buffers; it returns them updated as Keras's own training-mode call does."""
    if importlib.util.find_spec("keras") is None:
        pytest.skip(KERAS)
    from pipelines.frontends.keras import load_keras

    keras = load_keras()
    channels, height, width = cnn_jax.IMAGE
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((height, width, channels)),
        keras.layers.Conv2D(8, 3, padding="same", name="conv"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, name="fc")], name="bn_cnn")
    step, compiled, apply, params, buffers = compile_keras(host_profile, tmp_path, model)
    layers = compiled.layers
    assert sorted(buffers) == ["bn/moving_mean", "bn/moving_variance"]
    assert "bn/moving_mean" not in [p["name"] for p in layers["parameters"]]
    assert {p["name"]: p["kind"] for p in layers["parameters"]}["bn/gamma"] == "norm"
    nhwc = [(x.transpose(0, 2, 3, 1).copy(), y) for x, y in batches()]
    got = run_compiled(step, nhwc)
    assert_same(got, jax_reference(apply, params, nhwc, buffers), "keras batch norm")
    assert np.abs(got[1]["bn/moving_mean"]).max() > 0  # the statistics moved


@pytest.mark.slow
def test_onnx_mobilenet_selects_the_same_layers_and_steps_like_pytorch(tmp_path, params,
                                                                       host_profile):
    torch.manual_seed(0)
    model = MobileNetV2(width=0.35, num_classes=10)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = onnx_file(model, torch.zeros(1, 3, 32, 32), tmp_path / "mbv2.onnx")
    loaded = load_onnx(path)
    # Fresh batch-norm statistics equal fresh affine parameters (0 and 1): torch.onnx shares
    # them through Identity nodes, which must not make a running mean a trained bias.
    assert any(n.op_type == "Identity" for n in loaded.graph.node)
    patterns = ["features.[1-9]", "features.1[0-7]"]  # the inverted-residual blocks
    prepared = prepare(loaded, 8)
    layers = describe_onnx(prepared, trainable(prepared), patterns)
    assert layers["blocks"] == model.blocks()
    torch_layers = describe_layers(model)
    assert layers["parameters"] == torch_layers["parameters"]
    rules = params.schemes["mbv2_paper"].rules
    step, compiled = compile_onnx(path, host_profile, tmp_path / "build", 8, rules, patterns)
    assert compiled.layers == layers
    # The step was built with what the scheme selects of the PyTorch module.
    selected = selection_of(step.signature)
    assert selected == select(rules, torch_layers)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 32, 32)).astype("float32")
    y = rng.integers(0, 10, 8).astype("int64")
    reference = MobileNetV2(width=0.35, num_classes=10).train()
    reference.load_state_dict(state)
    # the scheme trains no norm: every batch norm keeps its statistics, in both
    held = step.signature["frozen_statistics"]
    assert len(held) == 52
    hold_statistics(reference, held)
    want = train_step(reference, make_optimizer(reference, OPT, selected), x, y)
    assert step.step(x, y) == pytest.approx(want, rel=1e-5)
    after, ref_state = step.state_dict(), reference.state_dict()
    assert set(after) == {k for k in ref_state if not k.endswith("num_batches_tracked")}
    for name, value in after.items():  # tolerance as conftest's change_rtol (ReLU6 ulps)
        ref_change = (ref_state[name] - state[name]).numpy()
        error = float(np.linalg.norm(value.numpy() - state[name].numpy() - ref_change))
        assert error <= 1e-6 * np.sqrt(ref_change.size) + 0.02 * np.linalg.norm(ref_change), name
        if name not in selected:  # frozen, statistics held
            np.testing.assert_array_equal(value.numpy(), state[name].numpy(), err_msg=name)


@pytest.mark.parametrize("frontend", ["onnx", "jax"])
def test_a_model_file_imports_deterministically_without_a_pytorch_module(tmp_path, frontend):
    """`experiment=model model@models.model=<frontend>`: the import and lower phases on the
    model file (no weights of a PyTorch module: the file holds them) name the parameters as
    the source does, and importing again writes byte-identical files. What needs the model as
    a PyTorch module (its twin) says so."""
    if frontend == "jax" and importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is an optional extra: pip install -e '.[jax]'")
    overrides = ["experiment=model", f"model@models.model={frontend}"]
    if frontend == "onnx":
        onnx_file(torch_cnn(), torch.zeros(1, *cnn_jax.IMAGE), tmp_path / "cnn.onnx")
        overrides.append(f"models.model.source={tmp_path / 'cnn.onnx'}")
    params = compose_params(*overrides)
    model = params.models["model"]
    assert params.cases["model"].model == "model" and model.pretrain is None
    imported = []
    for attempt in ("first", "again"):
        out = tmp_path / attempt
        out.mkdir()
        import_model(model, tmp_path / "no_weights", out)  # never read for a model file
        imported.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert imported[0] == imported[1]
    layers = json.loads(imported[0]["layers.json"])
    assert [p["name"] for p in layers["parameters"]] == (
        list(shared_weights()) if frontend == "onnx" else sorted(shared_weights()))
    lowered = lower_model(model, tmp_path / "first")
    names, values = lowered.names, lowered.values
    assert {source: values[r].tolist() for r, (_, source) in names.items()} == {
        k: v.tolist() for k, v in shared_weights().items()}
    from pipelines.frontends.twin import torch_twin

    with pytest.raises(ConfigError, match=f"needs a torch or transformers model; this one's "
                                          f"frontend is '{frontend}'"):
        torch_twin(model, {}, {})


def tiny_graph(op: str, path, inputs=("x",), shape=(2, 4)):
    """A small ONNX model: ``logits = op(MatMul(x, w))`` with a 4x4 weight initializer ``w``
    (the op's node is named my_<op>), ``x`` plus any further ``inputs``, of ``shape`` (names
    for dynamic dimensions)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="linear"),
             helper.make_node(op, ["y", *inputs[1:]], ["logits"], name=f"my_{op.lower()}")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, list(shape)) for i in inputs],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype="float32").ravel())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_onnx_bad_input_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such ONNX file"):
        load_onnx(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07not a model" * 10)
    with pytest.raises(ConfigError, match=r"junk\.onnx: not a valid ONNX model"):
        load_onnx(junk)
    # An operator TVM's frontend has no converter for: the op and its node are named.
    celu = load_onnx(tiny_graph("Celu", tmp_path / "celu.onnx"))
    with pytest.raises(ConfigError, match=r"celu\.onnx: .*Celu \(node 'my_celu'\)"):
        check_supported(celu.graph, tmp_path / "celu.onnx")
    # A Dropout exported in training mode draws random numbers (TVM's is the identity).
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    drop = helper.make_graph([
        helper.make_node("Constant", [], ["ratio"],
                         value=helper.make_tensor("r", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Constant", [], ["training"],
                         value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="my_dropout")],
        "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    with pytest.raises(ConfigError, match=r"node 'my_dropout' \(Dropout\) draws random"):
        check_supported(drop, tmp_path / "drop.onnx")
    # Several inputs are the step's inputs, in order; a dynamic dimension other than the
    # batch is bound by name from the model's dims, or named in the error.
    two = load_onnx(tiny_graph("Add", tmp_path / "two.onnx", inputs=("x", "z"),
                               shape=["batch", "width"]))
    with pytest.raises(ConfigError, match=r"two\.onnx: input 'x' has a dynamic dimension "
                                          r"'width' at axis 1; bind it .*dims: \{width: "):
        prepare(two, 2, tmp_path / "two.onnx")
    func, _, _ = translate_onnx(prepare(two, 2, tmp_path / "two.onnx", {"width": 4}))
    assert [p.name for p in func.params[:int(func.attrs["num_input"])]] == ["x", "z"]


def test_onnx_op_without_gradient_rule_names_the_node(tmp_path):
    model = prepare(load_onnx(tiny_graph("ReduceProd", tmp_path / "prod.onnx")), 2)
    func, _, origins = translate_onnx(model, tmp_path / "prod.onnx")
    with pytest.raises(MissingGradientRule, match=r"relax\.prod in layer my_reduceprod "
                                                  r"\(ReduceProd\)"):
        build_train_step(func, 1, from_config(OPT), origins)


def test_jax_and_keras_bad_input_is_named(tmp_path):
    pytest.importorskip("jax", reason="JAX is an optional extra: pip install -e '.[jax]'")
    import jax.numpy as jnp
    from jax import lax

    from pipelines.frontends.jax import load_jax_file
    from pipelines.frontends.stablehlo import stablehlo_text, translate_stablehlo

    params = {"fc": {"weight": np.ones((4, 4), "float32")}}
    x = np.zeros((2, 4), "float32")
    # An op with no converter, and a form of a known op that is not converted: op and place.
    text, names, _ = stablehlo_text(lambda p, x: jnp.sort(x @ p["fc"]["weight"], axis=1),
                                    params, x)
    with pytest.raises(ConfigError, match=r"sorted\.mlir: StableHLO ops with no converter: "
                                          r"stablehlo\.sort \(op #\d+ of @sort\)"):
        translate_stablehlo(text, names, "sorted.mlir")
    text, names, _ = stablehlo_text(
        lambda p, x: lax.reduce_window(x @ p["fc"]["weight"], 0.0, lax.add, (1, 2), (1, 2),
                                       "VALID"), params, x)
    with pytest.raises(ConfigError, match=r"stablehlo\.reduce_window \(op #\d+ of its "
                                          r"function\) cannot be converted: .*max pooling"):
        translate_stablehlo(text, names, "summed.mlir")
    text, _, _ = stablehlo_text(  # a dilated window is refused, not pooled as plain
        lambda p, x: lax.reduce_window(x * p["fc"]["weight"], -jnp.inf, lax.max, (1, 1, 2, 2),
                                       (1, 1, 1, 1), "VALID", window_dilation=(1, 1, 2, 2)),
        params, np.zeros((1, 1, 4, 4), "float32"))
    with pytest.raises(ConfigError, match="undilated max pooling"):
        translate_stablehlo(text, ["fc.weight"], "dilated.mlir")
    source = tmp_path / "model.py"
    source.write_text("def build(batch_size):\n    return None\n")
    model = model_section(frontend="jax", source=str(source), entry="model", batch_size=2)
    with pytest.raises(ConfigError, match=r"model\.py: no function 'model' "
                                          r"\(models\.<name>\.entry\)"):
        load_jax_file(model, source)

    if importlib.util.find_spec("keras") is None:
        pytest.skip(KERAS)
    from pipelines.frontends.keras import keras_function, load_keras, load_keras_file

    junk = tmp_path / "junk.keras"
    junk.write_bytes(b"not a zip archive")
    with pytest.raises(ConfigError, match=r"junk\.keras: not a Keras model file"):
        load_keras_file(junk, 2)
    keras = load_keras()
    dropping = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5, name="drop"),
                                 keras.layers.Dense(2)])
    with pytest.raises(ConfigError, match=r"non-float state .*\(random layers such as Dropout"):
        keras_function(dropping, 2)
