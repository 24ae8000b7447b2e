"""The compiled MobileNetV2 step (built through pipelines/compile.py, the chain DVC runs) against
PyTorch doing the identical update, for every named MobileNetV2 scheme of conf/sparse, a
channel-sparse scheme with every kind of slice, and the host's committed tuned schedules.

Tolerance (conftest.assert_steps_match): loss within 1e-4 relative; every updated tensor's
change (weights, running statistics) within 2% (L2) of PyTorch's change plus 1e-6 per element;
frozen parameters bit-identical. The slack is for ReLU6: where a float32 activation lands within
an ulp of 0 or 6, TVM and PyTorch can fall on opposite sides and pass or block that element's
gradient (seen as a 2% difference in one depthwise layer's weight gradient); a wrong update is
off by ~100% of the change. One step from a shared state: chained steps of a randomly
initialised ReLU6 network amplify those ulps chaotically (the transformer and optimizer tests
chain three steps at rtol 1e-4 elementwise).
"""
import numpy as np
import pytest

from conftest import assert_change_close, assert_steps_match, plan_case, random_batch
from pipelines.backend.databases import PRETUNED, open_database
from pipelines.config import case_optimizer
from pipelines.io import ROOT
from pipelines.runtime.step import CompiledStep

# Channel-sparse: every kind of slice the engine computes from sliced operands, plus a norm
# layer (sliced after its reduction) and a channel list out of order.
CHANNELS = [
    {"name": "pointwise", "modules": ["features.1[5-7].conv.0.0"], "channels": 0.25},
    {"name": "depthwise", "modules": ["features.16.conv.1.0"], "channels": [100, 3, 7, 1]},
    {"name": "project_in", "modules": ["features.17.conv.2"], "channels": 0.5, "axis": "input"},
    {"name": "norm", "modules": ["features.17.conv.0.1"], "channels": 0.5},
    {"name": "head_in", "modules": ["features.18.0"], "channels": 0.3, "axis": "input"},
    {"name": "classifier", "modules": ["classifier.1"], "channels": [0, 2, 5]}]
MBV2_SCHEMES = ["full", "mbv2_channels", "tiny_budget", "bias_only", "last_k"]


def check(params, compiled, seed=0):
    model = params.models["mbv2"]
    return assert_steps_match(compiled, model, case_optimizer(params, params.cases["mbv2"]),
                              [random_batch(compiled, seed)], change_rtol=0.02)


def test_the_papers_scheme_steps_like_pytorch(params, build_case):
    """The fast lane's compiled-vs-PyTorch check."""
    compiled = build_case(params, "mbv2")
    before, after = check(params, compiled)
    trainable = set(compiled.signature["trainable"])
    assert 0 < len(trainable) < compiled.signature["num_params"] / 2
    assert len(compiled.signature["frozen_statistics"]) == 52  # the scheme trains no norm
    for name in compiled.signature["source_names"].values():
        if name.startswith("features.0."):
            # the first layers are frozen: bit-identical, their batch norms' statistics held
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())


def test_every_layers_statistics_move_when_the_scheme_says_so(params, build_case):
    """``statistics: every_layer``: PyTorch's train mode in every batch norm, frozen or not."""
    compiled = build_case(params, "mbv2", statistics="every_layer")
    assert compiled.signature["frozen_statistics"] == []
    before, after = check(params, compiled)
    assert not np.array_equal(after["features.0.1.running_var"].numpy(),
                              before["features.0.1.running_var"].numpy())


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [*MBV2_SCHEMES, "channels"])
def test_every_mbv2_scheme_steps_like_pytorch(params, build_case, scheme):
    rules = CHANNELS if scheme == "channels" else params.schemes[scheme].rules
    compiled = build_case(params, "mbv2", rules=rules, scheme_name=scheme)
    before, after = check(params, compiled, seed=1)
    for param, selection in compiled.signature["channels"].items():  # unselected channels
        name = compiled.signature["source_names"][param]
        rest = [c for c in range(before[name].shape[selection["axis"]])
                if c not in selection["index"]]
        np.testing.assert_array_equal(after[name].numpy().take(rest, selection["axis"]),
                                      before[name].numpy().take(rest, selection["axis"]), name)
    if scheme == "channels":  # conv and linear slices come from sliced operands, not whole
        assert {p for p, s in compiled.signature["channels"].items()
                if s["gradient"] != "operands"} <= {"p_features_17_conv_0_1_weight",
                                                    "p_features_17_conv_0_1_bias"}


@pytest.mark.slow
def test_step_with_the_committed_tuned_schedules_matches_pytorch(params, build_case):
    """The host's pre-tuned schedules (MetaSchedule's) in place of the default ones: a
    kernel's own record, or its convolution's record where a frozen batch norm fused into the
    convolution made the kernel one the records do not hold."""
    database = open_database(ROOT / PRETUNED / "host")
    compiled = build_case(params, "mbv2", database=database)
    taken = compiled.built["kernel_schedules"]
    assert taken["tuned"] > 0 and taken["anchor"] > 0  # the records apply, both ways
    check(params, compiled, seed=2)


def assert_same_step(builds: list, name: str):
    """Two builds of one step, stepped once from the same state on the same batch, make the
    same change: the loss within 1e-6, each state tensor's change within 2% of its L2 norm
    (the MobileNetV2 tests' tolerance) plus 3e-5 per element. Reordering changes what fuses
    with what and each build times its products' backends (backend/blas.py), so a reduction
    may sum in another order; a recomputed batch norm then puts a ReLU6 input on either side
    of 0 or 6 (seen: the first batch norm's weight momentum off by 1.4% in one element), and a
    convolution's bias before a batch norm, whose gradient is zero, moves by float noise (seen:
    up to 6e-6). A misplaced, dropped or overwritten value is off by ~100% of the change."""
    steps = [CompiledStep(b.directory, b.initial) for b in builds]
    before = {key: value.numpy().copy() for key, value in steps[1].state.items()}
    batch = random_batch(builds[0], 3)
    losses = [step.step(*batch) for step in steps]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for key, value in steps[0].state.items():
        assert_change_close(f"{name}: {key}", before[key], value.numpy(),
                            steps[1].state[key].numpy(), 0.02, 3e-5)


@pytest.mark.slow
def test_reordered_and_recomputing_steps_give_the_same_step(params, build_case):
    """Update reordering moves each update next to its gradient, and recomputation makes cheap
    activations again in the backward pass: the planned peak falls with each, the results do
    not move. Full BP: with its tensors placed in one arena (backend/arena_plan.py), the paper
    scheme's step keeps too little for recomputation to lower its peak."""
    options = {"plain": {"reorder_updates": False, "recompute": "never"},
               "recomputed": {"reorder_updates": True, "recompute": "always"}}
    # the plain step against the one both change: either change moving a value shows
    builds = {name: build_case(params, "mbv2_full", **kw) for name, kw in options.items()}
    peaks = {name: b.build.plan["planned_peak_bytes"] for name, b in builds.items()}
    reordered = plan_case(params, "mbv2_full", reorder_updates=True, recompute="never")[2]
    assert peaks["recomputed"] < reordered.plan["planned_peak_bytes"] <= peaks["plain"]
    assert_same_step(list(builds.values()), "reordered and recomputed")


@pytest.mark.slow
def test_one_arena_holds_less_than_storage_tokens_with_the_same_step(params, build_case,
                                                                     monkeypatch):
    """The planned tensors placed in one arena by their lifetimes (backend/arena_plan.py) hold
    less than StaticPlanBlockMemory's tokens, and the step computes the same values: the same
    kernels in the same order, only where their tensors live differs (assert_same_step's
    tolerance); a tensor placed over another still alive would be off by whole values."""
    import tvm

    from pipelines import compile as chain
    from pipelines.backend import build

    arena = build_case(params, "mbv2", statistics="every_layer")
    planning = build.PLANNED[:-1]  # StaticPlanBlockMemory's tokens, without arena_plan
    assert build.arena_plan in build.PLANNED and build.arena_plan not in planning
    monkeypatch.setattr(chain, "PLAN", tvm.transform.Sequential(planning))
    monkeypatch.setattr(build, "CPU_PIPELINE", tvm.transform.Sequential(
        [p for p in build.CPU_PIPELINE.passes if p is not build.arena_plan]))
    # the same case under another key of build_case's cache: built with the tokens
    tokens = build_case(params, "mbv2", statistics="every_layer", reorder_updates=True)
    planned = {name: c.build.plan["planned_storage_bytes"]
               for name, c in (("arena", arena), ("tokens", tokens))}
    assert planned["arena"] < 0.9 * planned["tokens"], planned
    assert_same_step([arena, tokens], "arena")
