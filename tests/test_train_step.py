"""One compiled training step from a given state against PyTorch's step from the same state.

The state is the model's weights and batch-norm statistics plus a non-zero SGD momentum for every
trained parameter, so the optimizer's full update rule is exercised. Tolerance:
- loss within 1e-5 relative;
- every updated tensor (weights, running statistics): the L2 norm of (compiled change - PyTorch
  change) within 2% of the L2 norm of PyTorch's change, plus 1e-6 per element (L2: 1e-6*sqrt(n);
  a running mean whose true change is ~1e-10 still carries float32 noise of ~1e-7).
Most gradients agree with a float64 PyTorch reference to 1e-4. The slack is for ReLU6: where a
float32 activation lands within an ulp of 0 or 6, TVM and PyTorch can fall on opposite sides and
pass or block that element's gradient (seen as a 2% difference in one depthwise layer's weight
gradient). A wrong update is off by ~100% of the change. Steps are compared from one shared state,
not chained: chained steps of a randomly initialised network amplify those ulps chaotically.
"""

import numpy as np
import pytest
import torch
import tvm
import yaml

from pipelines.config import CONF
from pipelines.models import MobileNetV2
from pipelines.step import CompiledStep, save_step
from pipelines.torch_ref import make_optimizer, train_step
from pipelines.backends import switch_backends
from pipelines.tuning import PRETUNED, apply_database, open_database
from stages.autodiff.optimizers import from_config
from stages.autodiff.training import build_train_step
from stages.importer.layers import describe_layers
from stages.lower.translate import translate
from stages.optimize.passes import optimize
from stages.prune.prune import prune_step, sparse_step
from stages.prune.scheme import select

HOST = tvm.target.Target({"kind": "llvm"})
OPT = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
# Every named scheme for MobileNetV2 in conf/sparse; the text models' schemes are tested with
# their models (tests/test_transformer.py, tests/test_minilm.py, LoRA in tests/test_lora.py).
TEXT_SCHEMES = {"transformer_paper", "minilm_paper", "llama_lora", "minilm_lora"}
NAMED = {path.stem: yaml.safe_load(path.read_text())
         for path in sorted((CONF / "sparse").glob("*.yaml")) if path.stem not in TEXT_SCHEMES}
MBV2_PAPER = NAMED["mbv2_paper"]
# Channel-sparse: every kind of slice the engine computes from sliced operands, plus a norm
# layer (sliced after its reduction) and a channel list out of order.
CHANNELS = {"name": "channels", "rules": [
    {"name": "pointwise", "modules": ["features.1[5-7].conv.0.0"], "channels": 0.25},
    {"name": "depthwise", "modules": ["features.16.conv.1.0"], "channels": [100, 3, 7, 1]},
    {"name": "project_in", "modules": ["features.17.conv.2"], "channels": 0.5, "axis": "input"},
    {"name": "norm", "modules": ["features.17.conv.0.1"], "channels": 0.5},
    {"name": "head_in", "modules": ["features.18.0"], "channels": 0.3, "axis": "input"},
    {"name": "classifier", "modules": ["classifier.1"], "channels": [0, 2, 5]}]}


@pytest.fixture(scope="module")
def model_and_program():
    torch.manual_seed(0)
    model = MobileNetV2(width=0.35, num_classes=10).train()
    program = torch.export.export(model, (torch.zeros(8, 3, 32, 32),))
    main, names, _ = translate(program)
    num_params = sum(1 for kind, _ in names.values() if kind == "parameter")
    full, signature = build_train_step(main, num_params, from_config(OPT))
    signature["torch_names"] = {n: t for n, (_, t) in names.items()}
    signature["num_params"] = num_params
    return model, full, signature


def compile_scheme(tmp_path, model, full, signature, scheme, database=None):
    selected = select(scheme, describe_layers(model))
    pruned, sig, slicing = sparse_step(full, signature, selected)
    # Conv and linear gradients come from sliced operands, not a whole gradient; only the norm
    # layer's reductions are computed whole and sliced after.
    assert {p for p, how in slicing.items() if how != "operands"} <= {
        "p_features_17_conv_0_1_weight", "p_features_17_conv_0_1_bias"}, slicing
    sig["scheme"] = scheme["name"]
    mod = optimize(pruned, sig, reorder=False)
    save_step(mod, sig, HOST, tmp_path, database=database)
    if database is not None:  # the records must apply to this step, or nothing is tested
        assert apply_database(switch_backends(mod, {}), HOST, database)[1]
    return selected


@pytest.mark.parametrize("scheme", [*NAMED.values(), CHANNELS], ids=lambda s: s["name"])
def test_compiled_step_matches_pytorch(tmp_path, model_and_program, scheme):
    step_matches_pytorch(tmp_path, model_and_program, scheme)


def test_step_with_the_committed_tuned_schedules_matches_pytorch(tmp_path, model_and_program):
    """The host's pre-tuned schedules (device_profiles/tuned/host, MetaSchedule's) in place of
    the default ones for the kernels they cover."""
    step_matches_pytorch(tmp_path, model_and_program, MBV2_PAPER,
                         open_database(PRETUNED / "host"))


def step_matches_pytorch(tmp_path, model_and_program, scheme, database=None):
    model, full, signature = model_and_program
    selected = compile_scheme(tmp_path, model, full, signature, scheme, database)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    initial = {r: state[t] for r, t in signature["torch_names"].items()}
    step = CompiledStep(tmp_path, initial)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 3, 32, 32)).astype("float32")
    y = rng.integers(0, 10, 8).astype("int64")
    reference = MobileNetV2(width=0.35, num_classes=10).train()
    reference.load_state_dict(model.state_dict())
    opt = make_optimizer(reference, OPT, selected)
    relax_of = {t: r for r, t in signature["torch_names"].items()}
    for name, channels in selected.items():  # the same non-zero momentum on both sides
        shape = step.state[f"m_{relax_of[name]}"].shape
        momentum = (rng.standard_normal(shape) * 0.01).astype("float32")
        step.state[f"m_{relax_of[name]}"] = tvm.runtime.tensor(momentum)
        param = opt.slice_of(name) if channels else reference.get_parameter(name)
        opt.state[param]["momentum_buffer"] = torch.tensor(momentum)
    got = step.step(x, y)
    want = train_step(reference, opt, torch.from_numpy(x), torch.from_numpy(y))
    assert got == pytest.approx(want, rel=1e-5)

    after = step.torch_state_dict()
    step.load_into(MobileNetV2(width=0.35, num_classes=10))  # every weight and statistic carried
    ref_state = reference.state_dict()
    for name, value in after.items():
        ref_change = ref_state[name].numpy() - state[name]
        error = float(np.linalg.norm(value.numpy() - state[name] - ref_change))
        if name in selected:
            assert np.abs(ref_change).max() > 0, f"PyTorch did not update {name}"
        assert error <= 1e-6 * np.sqrt(ref_change.size) + 0.02 * float(np.linalg.norm(ref_change)), name
    # Frozen parameters are not even outputs of the step: they keep their initial values.
    frozen = [n for n, _ in model.named_parameters() if n not in selected]
    for name in frozen:
        np.testing.assert_array_equal(after[name].numpy(), state[name])
    for name, channels in selected.items():  # and so do unselected channels
        if channels:
            rest = [c for c in range(state[name].shape[channels["axis"]])
                    if c not in channels["index"]]
            np.testing.assert_array_equal(after[name].numpy().take(rest, channels["axis"]),
                                          state[name].take(rest, channels["axis"]), name)
    if scheme is MBV2_PAPER:
        assert len(step.signature["trainable"]) == len(selected) < len(frozen)


def test_reordered_and_recomputing_steps_give_the_same_step(tmp_path, model_and_program):
    """Operator reordering moves each update next to its gradient, and recomputation makes
    cheap activations again in the backward pass instead of keeping them: the results must not
    move, and recomputation must keep fewer activations."""
    from stages.optimize.passes import memory_plan, update_outputs
    from stages.optimize.recompute import recompute
    from stages.optimize.schedule import classify, reorder_updates, saved_for_backward

    model, full, signature = model_and_program
    selected = select(MBV2_PAPER, describe_layers(model))
    relax_of = {t: r for r, t in signature["torch_names"].items()}
    pruned, sig = prune_step(full, signature, {relax_of[n] for n in selected})
    outputs = update_outputs(sig)
    reordered = reorder_updates(pruned, outputs)

    def first_update(func):
        kinds = classify(func, outputs)
        bindings = func.body.blocks[0].bindings
        return min(i for i, b in enumerate(bindings) if kinds[b.var] == "update"
                   and b.var.name.startswith("opt_"))

    assert first_update(reordered) < first_update(pruned)
    recomputing, dropped = recompute(reordered, outputs)
    assert dropped > 0
    assert saved_for_backward(recomputing, outputs) < 0.7 * saved_for_backward(reordered, outputs)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    initial = {r: state[t] for r, t in signature["torch_names"].items()}
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 3, 32, 32)).astype("float32")
    y = rng.integers(0, 10, 8).astype("int64")
    results, peaks = [], []
    for name in ("plain", "reordered", "recomputed"):
        out = tmp_path / name
        out.mkdir()
        mod = optimize(pruned, sig, reorder=name != "plain", recomputed=name == "recomputed")
        peaks.append(memory_plan(mod, sig)["planned_peak_bytes"])
        save_step(mod, dict(sig, scheme="mbv2_paper"), HOST, out)
        step = CompiledStep(out, initial)
        loss = step.step(x, y)
        results.append((loss, {n: v.numpy() for n, v in step.state.items()}))
    assert peaks[2] < peaks[1]
    loss_a, state_a = results[0]
    for loss_b, state_b in results[1:]:
        assert loss_a == pytest.approx(loss_b, rel=1e-6)
        for name in state_a:
            np.testing.assert_allclose(state_b[name], state_a[name], rtol=1e-6, atol=1e-7,
                                       err_msg=name)
