"""In-graph optimizers against torch.optim over several chained steps, and the optimizer state
taken out of the compiled step into torch.optim.

The model is a small tanh MLP: smooth, so chained float32 steps of TVM and PyTorch stay within
rounding of each other (a ReLU network can flip an activation's side on an ulp and diverge).
Besides all parameters and the last layer, a channel-sparse selection updates some input
channels of the first layer and some output channels of the last (PyTorch side: full gradient,
then only the selected slice stepped); its other channels must stay bit-identical.
Tolerance: loss at every step within 1e-5 relative; weights and optimizer state after the last
step within rtol 1e-4, atol 1e-6 (with gradient accumulation, of PyTorch's float32 step, or of
its float64 step where the float32 one is not within them of it: assert_as_pytorch). The
all-parameters and channel cases also go through update reordering. The state taken out into
torch.optim is bit-identical, and PyTorch's next step from it matches the next compiled one
(loss 1e-5 relative, state rtol 1e-5, atol 1e-7). With gradient accumulation, each call's loss
and the weights after every optimizer step are PyTorch's summing ``loss / steps`` gradients
(same tolerances), and between optimizer steps the weights do not move at all.

Each step goes through the library's phases (pipelines/compile.py): training_graph,
prune (the selection as given), optimize, build for the host profile, every matrix product generated (which
backend a product runs on is tests/test_backends.py's subject). The fast lane runs every
optimizer and every selection once; the other pairs are slow.
"""

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter

from pipelines.compile import build, optimize, prune, training_graph
from pipelines.config import Optimizer
from pipelines.frontends.torch_program import translate
from pipelines.ir import signature_of
from pipelines.phases import Lowered, PrunedStep
from pipelines.models.pytorch import accumulated_step, make_optimizer, train_step
from pipelines.runtime.step import CompiledStep

STEPS = 5
CONFIGS = {name: TypeAdapter(Optimizer).validate_python(cfg) for name, cfg in {
    "sgd": {"kind": "sgd", "lr": 0.1},
    "sgd_momentum_wd": {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "nesterov": {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True,
                 "weight_decay": 0.01},
    "adam": {"kind": "adam", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
             "weight_decay": 0.01},
    "adamw": {"kind": "adamw", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6,
              "weight_decay": 0.1},
}.items()}


@pytest.fixture(scope="module")
def lowered():
    """The MLP exported and translated once (the initial values come from the module)."""
    main, names, origins = translate(torch.export.export(make_model(), (torch.zeros(8, 12),)))
    return Lowered(main, names, origins, values={}, layers={})


@pytest.fixture
def generated(monkeypatch):
    """Builds keep every product generated: nothing measured, as no backend is chosen."""
    monkeypatch.setattr("pipelines.backend.blas.measure", lambda mod, target: {})


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def compile_step(tmp_path, profile, lowered, cfg, trainable=None, reorder=False):
    full = training_graph(lowered, cfg).module
    selection = dict.fromkeys(signature_of(full)["source_names"].values() if trainable is None
                              else trainable)
    if isinstance(trainable, dict):
        selection.update(trainable)
    pruned = prune(full, selection, "test")
    # Every channel slice is computed from sliced operands, never the whole gradient.
    channels = signature_of(pruned)["channels"]
    assert all(c["gradient"] == "operands" for c in channels.values()), channels
    assert len(channels) == (3 if isinstance(trainable, dict) else 0)
    optimized = optimize(PrunedStep(pruned, [], {}), reorder_updates=reorder)
    build(optimized.module, optimized.plan, profile, tmp_path)
    state, names = make_model().state_dict(), signature_of(optimized.module)["source_names"]
    return CompiledStep(tmp_path, {r: state[t].numpy() for r, t in names.items()})


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield (rng.standard_normal((8, 12)).astype("float32"),
               rng.integers(0, 5, 8).astype("int64"))


CHANNELS = {"0.weight": {"axis": 1, "index": [1, 4, 7, 8, 9]}, "0.bias": None,
            "2.weight": {"axis": 0, "index": [0, 1, 2]}, "2.bias": {"axis": 0, "index": [3]}}
SELECTIONS = {"all": None, "last_layer": ["2.weight", "2.bias"], "channels": CHANNELS}
# The fast lane: every optimizer once and every selection at least once; the other pairs slow.
FAST = {("sgd", "last_layer"), ("sgd_momentum_wd", "channels"), ("nesterov", "last_layer"),
        ("adam", "channels"), ("adamw", "all")}


@pytest.mark.parametrize("name, trainable", [
    pytest.param(name, trainable, id=f"{name}-{selection}",
                 marks=() if (name, selection) in FAST else pytest.mark.slow)
    for name in CONFIGS for selection, trainable in SELECTIONS.items()])
def test_compiled_optimizer_matches_torch_optim(tmp_path, host_profile, lowered, generated, name,
                                                trainable):
    cfg = CONFIGS[name]
    # The all-parameters and channel cases run with operator reordering, last_layer without.
    compiled = compile_step(tmp_path, host_profile, lowered, cfg, trainable,
                            reorder=not isinstance(trainable, list))
    reference = make_model()
    optimizer = make_optimizer(reference, cfg, trainable)
    for x, y in batches():
        got = compiled.step(x, y)
        want = train_step(reference, optimizer, torch.from_numpy(x), torch.from_numpy(y))
        assert got == pytest.approx(want, rel=1e-5)

    initial = make_model().state_dict()
    for key, value in compiled.state_dict().items():
        np.testing.assert_allclose(value.numpy(), reference.state_dict()[key].numpy(),
                                   rtol=1e-4, atol=1e-6, err_msg=key)
        selected = (trainable or {}).get(key) if isinstance(trainable, dict) else None
        if selected:  # channels outside the selection are not touched at all
            axis, index = selected["axis"], selected["index"]
            rest = [c for c in range(value.shape[axis]) if c not in index]
            np.testing.assert_array_equal(value.numpy().take(rest, axis),
                                          initial[key].numpy().take(rest, axis))
            assert not np.array_equal(value.numpy(), initial[key].numpy())
    # The state taken out of the compiled step equals PyTorch's after the same steps ...
    taken = compiled.torch_optimizer(compiled.load_into(make_model())).state_dict()["state"]
    want_state = optimizer.state_dict()["state"]
    assert taken.keys() == want_state.keys()
    for index, slots in want_state.items():
        assert taken[index].keys() == slots.keys()
        for slot, value in slots.items():
            np.testing.assert_allclose(taken[index][slot].numpy(), value.numpy(),
                                       rtol=1e-4, atol=1e-6, err_msg=f"{index}.{slot}")


@pytest.mark.parametrize("name, trainable", [
    pytest.param("nesterov", None, id="nesterov", marks=pytest.mark.slow),
    pytest.param("adam", None, id="adam", marks=pytest.mark.slow),
    pytest.param("adam", CHANNELS, id="adam_channels")])
def test_state_taken_out_is_exact_and_training_continues_in_torch(tmp_path, host_profile, lowered,
                                                                  generated, name, trainable):
    cfg = CONFIGS[name]
    compiled = compile_step(tmp_path, host_profile, lowered, cfg, trainable)
    data = list(batches())
    for x, y in data[:-1]:
        compiled.step(x, y)
    # ... and is a lossless copy: weights and state bit for bit.
    model = compiled.load_into(make_model())
    optimizer = compiled.torch_optimizer(model)
    for key, value in compiled.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key].numpy(), value.numpy())
    names = dict(model.named_parameters())
    for state_name, info in compiled.optimizer_state.items():
        if info["slot"] == "lr":  # a param_groups key
            lrs = {group["lr"] for group in optimizer.optimizer.param_groups} if hasattr(
                optimizer, "optimizer") else {group["lr"] for group in optimizer.param_groups}
            assert lrs == {float(compiled.state[state_name].numpy())}
            continue
        owners = [info["param"]] if info["param"] else compiled.signature["trainable"]
        for owner in owners:
            torch_name = compiled.signature["source_names"][owner]
            param = (optimizer.slice_of(torch_name) if owner in compiled.signature["channels"]
                     else names[torch_name])
            np.testing.assert_array_equal(optimizer.state[param][info["torch"]].numpy(),
                                          compiled.state[state_name].numpy())
    # The next step in PyTorch from the exported state matches the next compiled step.
    x, y = data[-1]
    want = train_step(model, optimizer, torch.from_numpy(x), torch.from_numpy(y))
    assert compiled.step(x, y) == pytest.approx(want, rel=1e-5)
    for key, value in compiled.state_dict().items():
        np.testing.assert_allclose(value.numpy(), model.state_dict()[key].numpy(),
                                   rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("name, trainable", [
    pytest.param("adamw", None, id="adamw-all"),
    pytest.param("sgd_momentum_wd", CHANNELS, id="sgd_momentum_wd-channels")])
def test_accumulated_gradients_step_as_pytorch_accumulates(tmp_path, host_profile, lowered,
                                                           generated, name, trainable):
    """Three batches a step (gradient_accumulation_steps: 3), two steps: the compiled step
    called six times, PyTorch's accumulated_step twice on the same batches."""
    cfg = CONFIGS[name].model_copy(update={"gradient_accumulation_steps": 3})
    compiled = compile_step(tmp_path, host_profile, lowered, cfg, trainable, reorder=True)
    reference, exact = make_model(), make_model().double()
    optimizer = make_optimizer(reference, cfg, trainable)
    exact_optimizer = make_optimizer(exact, cfg, trainable)
    data = [(x, y) for x, y in batches()] + [next(batches())]
    initial = {k: v.numpy().copy() for k, v in compiled.state_dict().items()}
    for group in (data[:3], data[3:6]):
        got = [compiled.step(x, y) for x, y in group[:1]]
        for key, value in compiled.state_dict().items():  # mid-step: nothing moved
            np.testing.assert_array_equal(value.numpy(), initial[key], err_msg=key)
        got += [compiled.step(x, y) for x, y in group[1:]]
        want = accumulated_step(reference, optimizer, group, "classification")
        accumulated_step(exact, exact_optimizer, [(x.astype("float64"), y) for x, y in group],
                         "classification")
        assert got == pytest.approx(want, rel=1e-5)
        initial = {k: v.numpy().copy() for k, v in compiled.state_dict().items()}
        for key, value in initial.items():
            assert_as_pytorch(value, reference.state_dict()[key], exact.state_dict()[key], key)
    assert not np.array_equal(initial["2.weight"], make_model().state_dict()["2.weight"].numpy())
    taken = compiled.torch_optimizer(compiled.load_into(make_model())).state_dict()["state"]
    exact_state = exact_optimizer.state_dict()["state"]
    for index, slots in optimizer.state_dict()["state"].items():
        for slot, value in slots.items():
            assert_as_pytorch(taken[index][slot].numpy(), value, exact_state[index][slot],
                              f"{index}.{slot}")


def assert_as_pytorch(ours, pytorch, exact, name, rtol=1e-4, atol=1e-6):
    """Each element of ``ours`` within rtol / atol of PyTorch's float32 step, or, where that
    float32 step is itself not within them of PyTorch's float64 step, of the float64 step.
    AdamW divides by the gradient's root mean square: with 3 micro-batches summed, a tiny
    gradient's rounding moves PyTorch's float32 update by 1e-4 of the weight on some CPUs (on
    an AVX-512 one, where the compiled step stayed within 4e-7 of the float64 step)."""
    pytorch, exact = pytorch.numpy(), exact.numpy()
    close = lambda a, b: np.abs(a - b) <= atol + rtol * np.abs(b)  # noqa: E731
    agree = close(ours, pytorch) | (~close(pytorch, exact) & close(ours, exact))
    assert agree.all(), (f"{name}: {int((~agree).sum())} of {agree.size} elements, e.g. "
                         f"{ours[~agree][:3]} against PyTorch's {pytorch[~agree][:3]} "
                         f"(float64: {exact[~agree][:3]})")


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_a_rules_lr_scale_steps_as_its_own_torch_param_group(tmp_path, host_profile, name):
    """Biases at 4x the learning rate (a rule's ``lr_scale``) against torch.optim with the two
    param groups written out by hand, through a schedule's change of the learning rate; the
    state taken out keeps the groups."""
    from conftest import model_section
    from pipelines.compile import compile
    from pipelines.frontends.twin import torch_twin

    cfg = CONFIGS[name]
    model = model_section(frontend="torch", source="tests/frontends/task_heads.py",
                          entry="classifier", batch_size=8)
    compiled = compile(model, [{"modules": ["*"], "update": "weight"},
                               {"modules": ["*"], "update": "bias", "lr_scale": 4.0}],
                       cfg, host_profile, tmp_path)
    step = CompiledStep(compiled.directory, compiled.initial)
    twin = torch_twin(model, compiled.signature, compiled.initial)
    named = dict(twin.named_parameters())
    groups = [{"params": [p for n, p in named.items() if n.endswith("weight")]},
              {"params": [p for n, p in named.items() if n.endswith("bias")], "lr": cfg.lr * 4}]
    reference = (torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                                 weight_decay=cfg.weight_decay) if cfg.kind == "sgd"
                 else torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                        weight_decay=cfg.weight_decay))
    rng = np.random.default_rng(3)
    for i in range(4):
        if i == 2:  # a schedule halves the learning rate: each group's, its scale kept
            step.set_lr(cfg.lr / 2)
            for group, scale in zip(reference.param_groups, (1, 4)):
                group["lr"] = cfg.lr / 2 * scale
        x = rng.standard_normal((8, 5)).astype("float32")
        y = rng.integers(0, 3, 8)
        want = train_step(twin, reference, torch.from_numpy(x), torch.from_numpy(y))
        assert step.step(x, y) == pytest.approx(want, rel=1e-5)
    for key, value in step.state_dict().items():
        np.testing.assert_allclose(value.numpy(), twin.state_dict()[key].numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=key)
    taken = step.torch_optimizer(step.load_into(torch_twin(model, compiled.signature,
                                                           compiled.initial))).state_dict()
    assert [g["lr"] for g in taken["param_groups"]] == pytest.approx([cfg.lr / 2, cfg.lr * 2])
    for index, slots in reference.state_dict()["state"].items():
        for slot, value in slots.items():
            np.testing.assert_allclose(taken["state"][index][slot].numpy(), value.numpy(),
                                       rtol=1e-4, atol=1e-6, err_msg=f"{index}.{slot}")
