"""In-graph optimizers against torch.optim over several chained steps, and the optimizer state
taken out of the compiled step into torch.optim.

The model is a small tanh MLP: smooth, so chained float32 steps of TVM and PyTorch stay within
rounding of each other (a ReLU network can flip an activation's side on an ulp and diverge).
Besides all parameters and the last layer, a channel-sparse selection updates some input
channels of the first layer and some output channels of the last (PyTorch side: full gradient,
then only the selected slice stepped); its other channels must stay bit-identical.
Tolerance: loss at every step within 1e-5 relative; weights and optimizer state after the last
step within rtol 1e-4, atol 1e-6. The all-parameters and channel cases also go through update
reordering.
"""

import numpy as np
import pytest
import torch
import tvm

from pipelines.step import CompiledStep, save_step
from pipelines.torch_ref import make_optimizer, train_step
from stages.autodiff.optimizers import from_config
from stages.autodiff.training import build_train_step
from stages.lower.translate import translate
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step

STEPS = 5
CONFIGS = {
    "sgd": {"name": "sgd", "lr": 0.1},
    "sgd_momentum_wd": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "nesterov": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True,
                 "weight_decay": 0.01},
    "adam": {"name": "adam", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
             "weight_decay": 0.01},
    "adamw": {"name": "adamw", "lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6,
              "weight_decay": 0.1},
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def compile_step(tmp_path, cfg, trainable=None, reorder=False):
    model = make_model()
    program = torch.export.export(model, (torch.zeros(8, 12),))
    main, names, origins = translate(program)
    step, sig = build_train_step(main, len(names), from_config(cfg), origins)
    sig["torch_names"] = {n: t for n, (_, t) in names.items()}
    sig["num_params"] = len(names)
    selection = dict.fromkeys(sig["torch_names"].values() if trainable is None else trainable)
    if isinstance(trainable, dict):
        selection.update(trainable)
    step, sig, slicing = sparse_step(step, sig, selection)
    assert all(how == "operands" for how in slicing.values()), slicing
    save_step(optimize(step, sig, reorder), sig, tvm.target.Target({"kind": "llvm"}), tmp_path)
    initial = {r: model.state_dict()[t].numpy() for r, t in sig["torch_names"].items()}
    return CompiledStep(tmp_path, initial)


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        yield (rng.standard_normal((8, 12)).astype("float32"),
               rng.integers(0, 5, 8).astype("int64"))


CHANNELS = {"0.weight": {"axis": 1, "index": [1, 4, 7, 8, 9]}, "0.bias": None,
            "2.weight": {"axis": 0, "index": [0, 1, 2]}, "2.bias": {"axis": 0, "index": [3]}}


@pytest.mark.parametrize("trainable", [None, ["2.weight", "2.bias"], CHANNELS],
                         ids=["all", "last_layer", "channels"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_optimizer_matches_torch_optim(tmp_path, name, trainable):
    cfg = CONFIGS[name]
    # The all-parameters and channel cases run with operator reordering, last_layer without.
    compiled = compile_step(tmp_path, cfg, trainable, reorder=not isinstance(trainable, list))
    reference = make_model()
    optimizer = make_optimizer(reference, cfg, trainable)
    for x, y in batches():
        got = compiled.step(x, y)
        want = train_step(reference, optimizer, torch.from_numpy(x), torch.from_numpy(y))
        assert got == pytest.approx(want, rel=1e-5)

    initial = make_model().state_dict()
    for key, value in compiled.torch_state_dict().items():
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


@pytest.mark.parametrize("name, trainable", [("nesterov", None), ("adam", None),
                                             ("adam", CHANNELS)], ids=["nesterov", "adam",
                                                                       "adam_channels"])
def test_state_taken_out_is_exact_and_training_continues_in_torch(tmp_path, name, trainable):
    cfg = CONFIGS[name]
    compiled = compile_step(tmp_path, cfg, trainable)
    data = list(batches())
    for x, y in data[:-1]:
        compiled.step(x, y)
    # ... and is a lossless copy: weights and state bit for bit.
    model = compiled.load_into(make_model())
    optimizer = compiled.torch_optimizer(model)
    for key, value in compiled.torch_state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key].numpy(), value.numpy())
    names = dict(model.named_parameters())
    for state_name, info in compiled.optimizer_state.items():
        owners = [info["param"]] if info["param"] else compiled.signature["trainable"]
        for owner in owners:
            torch_name = compiled.signature["torch_names"][owner]
            param = (optimizer.slice_of(torch_name) if owner in compiled.signature["channels"]
                     else names[torch_name])
            np.testing.assert_array_equal(optimizer.state[param][info["torch"]].numpy(),
                                          compiled.state[state_name].numpy())
    # The next step in PyTorch from the exported state matches the next compiled step.
    x, y = data[-1]
    want = train_step(model, optimizer, torch.from_numpy(x), torch.from_numpy(y))
    assert compiled.step(x, y) == pytest.approx(want, rel=1e-5)
    for key, value in compiled.torch_state_dict().items():
        np.testing.assert_allclose(value.numpy(), model.state_dict()[key].numpy(),
                                   rtol=1e-5, atol=1e-7, err_msg=key)
