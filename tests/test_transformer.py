"""The LLaMA-style decoder through the compiler: its gradient rules (rsqrt, strided_slice) in a
whole training step, the paper's transformer scheme (with cheap activations recomputed), and
channel-sparse linear layers.

A small decoder (2 blocks, d=32, vocab 64, batch 2 x seq 16) on random tokens; three chained
SGD-momentum steps compiled against PyTorch's. The network is smooth (no ReLU kinks), so the
tolerance is tight: loss within 1e-5 relative at every step; updated weights within rtol 1e-4,
atol 1e-6. Channels outside a selection, and frozen parameters, stay bit-identical.
"""

import numpy as np
import pytest
import tvm
import yaml

from conftest import chained_steps_match
from pipelines.config import CONF
from pipelines.step import save_step
from stages.optimize.passes import optimize, update_outputs
from stages.optimize.recompute import recompute
from stages.optimize.schedule import reorder_updates
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "llama_test", "arch": "llama", "vocab": 64, "dim": 32, "layers": 2, "heads": 2,
         "hidden": 48, "seq_len": 16, "batch_size": 2}
OPT = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
TRANSFORMER_PAPER = yaml.safe_load((CONF / "sparse" / "transformer_paper.yaml").read_text())
CHANNELS = {"name": "channels", "rules": [
    {"name": "attention", "modules": ["layers.1.attn.*_proj"]},
    {"name": "q_half", "modules": ["layers.0.attn.q_proj"], "channels": 0.5},
    {"name": "up_some_inputs", "modules": ["layers.0.mlp.up_proj"], "channels": [1, 5, 9],
     "axis": "input"},
    {"name": "down_quarter", "modules": ["layers.1.mlp.down_proj"], "channels": 0.25},
    {"name": "norm_quarter", "modules": ["layers.0.post_norm"], "channels": 0.25}]}


@pytest.fixture(scope="module")
def step():
    return full_step(MODEL, OPT)


def test_transformer_paper_selects_attention_and_first_ffn_linears(step):
    layers, _, _ = step
    chosen = select(TRANSFORMER_PAPER, layers)
    assert sorted(chosen) == sorted(
        [f"layers.{b}.attn.{p}_proj.weight" for b in (0, 1) for p in "qkvo"]
        + [f"layers.{b}.mlp.{p}_proj.weight" for b in (0, 1) for p in ("gate", "up")])
    assert not any("down_proj" in n or "norm" in n or "embed" in n for n in chosen)


@pytest.mark.parametrize("scheme", [TRANSFORMER_PAPER, CHANNELS], ids=lambda s: s["name"])
def test_compiled_decoder_step_matches_pytorch(tmp_path, step, scheme):
    layers, full, signature = step
    selection = select(scheme, layers)
    pruned, sig, slicing = sparse_step(full, signature, selection)
    assert all(how == "operands" for how in slicing.values()), slicing
    assert len(slicing) == (4 if scheme is CHANNELS else 0)
    sig = dict(sig, scheme=scheme["name"])
    # The paper scheme's step recomputes its cheap activations (norms, rotary, SwiGLU's silu).
    recomputing = scheme is TRANSFORMER_PAPER
    if recomputing:
        _, dropped = recompute(reorder_updates(pruned, update_outputs(sig)), update_outputs(sig))
        assert dropped > 0
    optimized = optimize(pruned, sig, reorder=True, recomputed=recomputing)
    # RMS norm's squares and their gradients (2 * x ** 1) are products, not powf calls.
    assert "T.pow(" not in optimized.script()
    save_step(optimized, sig, tvm.target.Target({"kind": "llvm"}), tmp_path)

    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, (2, 16)), rng.integers(0, 64, 32)) for _ in range(3)]
    before, after = chained_steps_match(tmp_path, MODEL, OPT, selection, sig, batches)
    for name, selected in selection.items():
        if selected:
            axis, index = selected["axis"], selected["index"]
            rest = [c for c in range(after[name].shape[axis]) if c not in index]
            np.testing.assert_array_equal(after[name].numpy().take(rest, axis),
                                          before[name].numpy().take(rest, axis))
            assert not np.array_equal(after[name].numpy(), before[name].numpy())
