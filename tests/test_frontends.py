"""Frontends: a model from another framework's file becomes the same kind of training step.

The same small CNN (conv, ReLU, max pool, conv, ReLU, mean, linear) with the same weights comes
in from each frontend; its compiled step must give PyTorch's loss and updated weights (two
chained steps: loss within 1e-5 relative, weights within rtol 1e-4, atol 1e-6). MobileNetV2
through ONNX (with training-mode batch norm) must select the same layers under a scheme and
step like PyTorch. Bad files and unsupported operators fail naming the file, op and node.
"""
import io

import numpy as np
import onnx
import pytest
import torch
import tvm
from onnx import TensorProto, helper

from pipelines.config import ConfigError
from pipelines.models import MobileNetV2
from pipelines.step import CompiledStep, save_step
from pipelines.torch_ref import make_optimizer, train_step
from stages.autodiff.optimizers import from_config
from stages.autodiff.training import MissingGradientRule, build_train_step
from stages.importer.layers import describe_layers, describe_onnx
from stages.lower.from_onnx import (check_supported, initial_values, load_onnx, prepare,
                                    trainable, translate_onnx)
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from tests.test_train_step import MBV2_PAPER

HOST = tvm.target.Target({"kind": "llvm"})
OPT = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
BATCH = 4
FULL = {"name": "full", "rules": [{"name": "everything", "modules": ["*"], "update": "both"}]}


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))


def onnx_file(model: torch.nn.Module, example: torch.Tensor, path):
    """``model`` exported as the import stage exports (inference mode, names kept), with a
    dynamic batch dimension as exporters usually leave it."""
    buffer = io.BytesIO()
    torch.onnx.export(model.eval(), (example,), buffer, dynamo=False, input_names=["x"],
                      output_names=["logits"], do_constant_folding=False,
                      dynamic_axes={"x": {0: "batch"}})
    path.write_bytes(buffer.getvalue())
    return path


def compile_onnx(path, tmp_path, batch=BATCH, scheme=FULL, patterns=()):
    """The import, lower, autodiff, sparse_prune, optimize and build stages' work on an ONNX
    file: (loaded step, its signature, the scheme's selection by ONNX name)."""
    model = prepare(load_onnx(path), batch)
    func, names, origins = translate_onnx(model, path)
    num_params = sum(1 for kind, _ in names.values() if kind == "parameter")
    step, signature = build_train_step(func, num_params, from_config(OPT), origins)
    signature["torch_names"] = {r: n for r, (_, n) in names.items()}
    signature["num_params"] = num_params
    selected = select(scheme, describe_onnx(model, trainable(model), list(patterns)))
    step, signature, _ = sparse_step(step, signature, selected)
    save_step(optimize(step, signature, reorder=True), signature, HOST, tmp_path)
    return CompiledStep(tmp_path, initial_values(model, names)), signature, selected


def test_onnx_small_cnn_steps_like_pytorch(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN()
    path = onnx_file(model, torch.zeros(1, 3, 16, 16), tmp_path / "cnn.onnx")
    step, signature, _ = compile_onnx(path, tmp_path)
    # Initializers keep their PyTorch names: one scheme language for both paths.
    assert sorted(signature["torch_names"].values()) == sorted(model.state_dict())
    optimizer = make_optimizer(model.train(), OPT, {n: None for n, _ in model.named_parameters()})
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = rng.standard_normal((BATCH, 3, 16, 16)).astype("float32")
        y = rng.integers(0, 10, BATCH).astype("int64")
        want = train_step(model, optimizer, torch.from_numpy(x), torch.from_numpy(y))
        assert step.step(x, y) == pytest.approx(want, rel=1e-5)
    after = step.torch_state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(after[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_onnx_mobilenet_selects_the_same_layers_and_steps_like_pytorch(tmp_path):
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
    step, signature, selected = compile_onnx(path, tmp_path, 8, MBV2_PAPER, patterns)
    assert selected == select(MBV2_PAPER, torch_layers)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 32, 32)).astype("float32")
    y = rng.integers(0, 10, 8).astype("int64")
    reference = MobileNetV2(width=0.35, num_classes=10).train()
    reference.load_state_dict(state)
    want = train_step(reference, make_optimizer(reference, OPT, selected), torch.from_numpy(x),
                      torch.from_numpy(y))
    assert step.step(x, y) == pytest.approx(want, rel=1e-5)
    after, ref_state = step.torch_state_dict(), reference.state_dict()
    assert set(after) == {k for k in ref_state if not k.endswith("num_batches_tracked")}
    for name, value in after.items():  # tolerance as tests/test_train_step.py (ReLU6 ulps)
        ref_change = (ref_state[name] - state[name]).numpy()
        error = float(np.linalg.norm(value.numpy() - state[name].numpy() - ref_change))
        assert error <= 1e-6 * np.sqrt(ref_change.size) + 0.02 * np.linalg.norm(ref_change), name
        if "running" in name:  # batch statistics, updated as PyTorch's train() does
            assert np.abs(ref_change).max() > 0, name


def tiny_graph(op: str, path, inputs=("x",)):
    """A small ONNX model: ``logits = op(MatMul(x, w))`` with a 4x4 weight initializer ``w``
    (the op's node is named my_<op>), ``x`` plus any further ``inputs``."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="linear"),
             helper.make_node(op, ["y", *inputs[1:]], ["logits"], name=f"my_{op.lower()}")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, [2, 4]) for i in inputs],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 4])],
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
    two = load_onnx(tiny_graph("Add", tmp_path / "two.onnx", inputs=("x", "z")))
    with pytest.raises(ConfigError, match=r"two\.onnx: .*takes \['x', 'z'\]"):
        prepare(two, 2, tmp_path / "two.onnx")


def test_onnx_op_without_gradient_rule_names_the_node(tmp_path):
    model = prepare(load_onnx(tiny_graph("Atan", tmp_path / "atan.onnx")), 2)
    func, names, origins = translate_onnx(model, tmp_path / "atan.onnx")
    with pytest.raises(MissingGradientRule, match=r"relax\.atan in layer my_atan \(Atan\)"):
        build_train_step(func, 1, from_config(OPT), origins)
