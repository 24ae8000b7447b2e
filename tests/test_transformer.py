"""The LLaMA-style decoder (pipelines/models/llama.py) through the compile chain: its gradient
rules (rsqrt, strided_slice) in a whole training step, the paper's transformer scheme (with
cheap activations recomputed), and channel-sparse linear layers.

The conftest's small llama_tiny (2 blocks, d=64, vocab 256, batch 2 x seq 16) on random tokens;
three chained SGD-momentum steps compiled against PyTorch's (tests/chained_steps.py). The
network is smooth (no ReLU kinks), so the tolerance is tight: loss within 1e-5 relative at every
step; updated weights within rtol 1e-4, atol 1e-6. Channels outside a selection, and frozen
parameters, stay bit-identical.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from chained_steps import chained_steps_match

from pipelines.config import SGD
from pipelines.frontends.layers import describe_layers
from pipelines.frontends import load_module
from pipelines.training.scheme import select

OPT = SGD(kind="sgd", lr=0.5, momentum=0.9)
CHANNELS = [
    {"name": "attention", "modules": ["layers.1.attn.*_proj"]},
    {"name": "q_half", "modules": ["layers.0.attn.q_proj"], "channels": 0.5},
    {"name": "up_some_inputs", "modules": ["layers.0.mlp.up_proj"], "channels": [1, 5, 9],
     "axis": "input"},
    {"name": "down_quarter", "modules": ["layers.1.mlp.down_proj"], "channels": 0.25},
    {"name": "norm_quarter", "modules": ["layers.0.post_norm"], "channels": 0.25}]


def kept_shapes(step, owners) -> set[tuple[int, int]]:
    """The last two dimensions of every forward value the step's backward pass reads."""
    from pipelines.analysis.liveness import block_of, classify, uses

    func = step["train_step"]
    kinds = classify(func, owners)
    shapes = [[int(d) for d in v.ty.shape]
              for b in block_of(func).bindings if kinds[b.var] != "forward"
              for v in uses(b.value) if kinds.get(v) == "forward"]
    return {tuple(shape[-2:]) for shape in shapes if len(shape) >= 2}


@pytest.fixture(scope="module")
def model(small):
    return small.models["llama_tiny"]


@pytest.fixture(scope="module")
def full_step(model, tmp_path_factory):
    """The full training step (every parameter updated), its initial values and layers."""
    from pipelines.compile import import_and_lower, training_graph

    full = training_graph(import_and_lower(model), OPT)
    return full.module, full.initial, full.layers


def test_transformer_paper_selects_attention_and_first_ffn_linears(small, model):
    torch.manual_seed(0)
    module, _ = load_module(model)
    chosen = select(small.schemes["transformer_paper"].rules, describe_layers(module))
    assert sorted(chosen) == sorted(
        [f"layers.{b}.attn.{p}_proj.weight" for b in (0, 1) for p in "qkvo"]
        + [f"layers.{b}.mlp.{p}_proj.weight" for b in (0, 1) for p in ("gate", "up")])
    assert not any("down_proj" in n or "norm" in n or "embed" in n for n in chosen)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["transformer_paper", "channels"])
def test_compiled_decoder_step_matches_pytorch(tmp_path, small, model, full_step, host_profile,
                                               scheme):
    from pipelines.analysis.liveness import saved_for_backward, update_owners
    from pipelines.compile import build, optimize, prune
    from pipelines.ir import signature_of
    from pipelines.phases import PrunedStep
    from pipelines.transform import RecomputeActivations, ReorderUpdates

    full, values, layers = full_step
    rules = CHANNELS if scheme == "channels" else small.schemes[scheme].rules
    selection = select(rules, layers)
    pruned = prune(full, selection, scheme)
    channels = signature_of(pruned)["channels"]
    # Every channel-sparse gradient is computed from sliced operands, never sliced afterwards.
    assert all(c["gradient"] == "operands" for c in channels.values()), channels
    assert len(channels) == (4 if scheme == "channels" else 0)
    # The paper scheme's step recomputes its cheap activations (norms, rotary, SwiGLU's silu):
    # it keeps fewer bytes from the forward pass for the backward pass.
    recomputing = scheme == "transformer_paper"
    if recomputing:
        reordered = ReorderUpdates()(pruned)
        owners = update_owners(signature_of(pruned))
        recomputed = RecomputeActivations()(reordered)
        assert saved_for_backward(recomputed["train_step"], owners) < (
            saved_for_backward(reordered["train_step"], owners))
        # Attention's probabilities (batch, heads, seq, seq) are kept without recomputation and
        # not with it: the backward pass makes them again from the queries and keys.
        seq = model.kwargs["seq_len"]
        assert (seq, seq) in kept_shapes(reordered, owners)
        assert (seq, seq) not in kept_shapes(recomputed, owners)
    optimized = optimize(PrunedStep(pruned, [], {}), reorder_updates=True,
                         recompute="always" if recomputing else "never")
    # RMS norm's squares and their gradients (2 * x ** 1) are products, not powf calls.
    assert "T.pow(" not in optimized.module.script()
    build(optimized.module, optimized.plan, host_profile, tmp_path)
    compiled = SimpleNamespace(directory=tmp_path, signature=signature_of(optimized.module),
                               initial=values)

    rng = np.random.default_rng(0)
    vocab, (batch, seq) = model.kwargs["vocab"], (model.batch_size, model.kwargs["seq_len"])
    batches = [(rng.integers(0, vocab, (batch, seq)), rng.integers(0, vocab, batch * seq))
               for _ in range(3)]
    before, after = chained_steps_match(compiled, model, OPT, batches)
    for name, selected in selection.items():
        if selected:
            axis, index = selected["axis"], selected["index"]
            rest = [c for c in range(after[name].shape[axis]) if c not in index]
            np.testing.assert_array_equal(after[name].numpy().take(rest, axis),
                                          before[name].numpy().take(rest, axis))
            assert not np.array_equal(after[name].numpy(), before[name].numpy())
