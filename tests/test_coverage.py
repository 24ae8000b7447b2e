"""The coverage suite over the transformers zoo (pipelines/coverage/, the stage in
coverage/dvc.yaml): its architecture list and shrunk configs, the table it writes, and in the
slow lane a sample of it (a dense decoder, a mixture-of-experts decoder, an encoder
classifier) through the chain, each matching PyTorch's step with the class's own loss."""
from types import SimpleNamespace

import pytest
import torch

from pipelines.coverage.check import (PHASES, TASKS, _float32_spread, _pytorch_step,
                                      _within_noise, architectures, check, summary,
                                      tiny_config)
from pipelines.coverage.run import run_all
from pipelines.coverage.table import cause, render


def test_the_zoo_is_transformers_own_auto_mappings():
    found = architectures()
    names = {name for _, _, name in found}
    assert {"LlamaForCausalLM", "MixtralForCausalLM", "BertForSequenceClassification",
            "ViTForImageClassification"} <= names
    assert {mapping for mapping, _, _ in found} == set(TASKS)
    assert len(found) > 300


def test_a_shrunk_config_has_two_layers_and_small_widths():
    config = tiny_config("qwen2_moe")
    assert config.num_hidden_layers == 2 and config.hidden_size == 32
    assert config.num_experts == 4 and config.num_labels == 4
    assert len(config.layer_types) == 2  # per-layer lists follow the depth


def test_shrinking_reaches_nested_configs_and_per_layer_settings():
    text = tiny_config("qwen3_5").text_config  # a multimodal model's text config
    assert text.num_hidden_layers == 2 and len(text.layer_types) == 2
    tiny_config("gemma4_text")  # settings by layer index, of layers 5, 11, ... (refused)
    mamba = tiny_config("mamba2")  # Mamba-2's heads x head size = expand x width
    assert mamba.num_heads * mamba.head_dim == mamba.expand * mamba.hidden_size


def test_shrinking_keeps_a_config_consistent_with_itself():
    latent = tiny_config("deepseek_v2")  # latent attention: rotary part, one latent per head
    assert latent.head_dim == latent.qk_rope_head_dim
    assert latent.qk_head_dim == latent.qk_nope_head_dim + latent.qk_rope_head_dim
    assert latent.num_key_value_heads == latent.num_attention_heads
    assert tiny_config("dinov2").out_features == ["stage2"]  # a backbone's last stage
    assert tiny_config("data2vec-vision").out_indices == [1]  # a layer's index: the last
    assert tiny_config("resnet").depths == [1, 1, 1, 1]  # a block per stage
    gptj = tiny_config("gptj")  # its rotary share within a head
    assert gptj.rotary_dim <= gptj.n_embd // gptj.n_head
    swin = tiny_config("swin")  # heads per stage; num_layers counts the stages
    assert swin.num_layers == len(swin.depths) == len(swin.num_heads) == 4
    assert all(swin.embed_dim * 2 ** i % heads == 0 for i, heads in enumerate(swin.num_heads))
    assert tiny_config("hiera").image_size == [64, 64]  # height and width
    assert tiny_config("esmc").num_key_value_heads == tiny_config("esmc").num_attention_heads
    squeeze = tiny_config("squeezebert")  # a width equal to the hidden size follows it
    assert squeeze.embedding_size == squeeze.hidden_size
    assert tiny_config("albert").embedding_size == 128  # one of its own stays
    assert "full_attention" in tiny_config("qwen3_5").text_config.layer_types  # every kind


def test_a_run_out_of_time_starts_no_check_and_keeps_the_records(tmp_path):
    records = tmp_path / "records.jsonl"
    assert run_all(records, tmp_path / "work", "code", 60, 1, "LlamaForCausalLM",
                   minutes=1e-9) == []
    assert records.read_text() == ""


def test_failures_group_by_cause_whatever_the_numbers_and_names():
    records = [
        {"task": "causal_lm", "model_type": "a", "architecture": "A", "phase": "ok"},
        {"task": "causal_lm", "model_type": "b", "architecture": "B", "phase": "differentiates",
         "error": "MissingGradientRule: operator relax.foo in layer 'x.0' (bound to lv3)"},
        {"task": "causal_lm", "model_type": "c", "architecture": "C", "phase": "differentiates",
         "error": "MissingGradientRule: operator relax.foo in layer 'y.1' (bound to lv12)"},
    ]
    assert cause(records[1]) == cause(records[2])
    counts = summary(records)["causal_lm"]
    assert counts["ok"] == 1 and counts["differentiates"] == 2 and counts["match_share"] == 0.3333
    records.append({"task": "causal_lm", "model_type": "d", "architecture": "D",
                    "phase": "config", "error": "ValueError: its default config"})
    counts = summary(records)["causal_lm"]
    assert counts["match_share"] == 0.25 and counts["match_share_of_pytorch_steps"] == 0.3333
    table = render(records, 5)
    assert "Checked: 4 of the 5 architectures (a run cut short" in table
    assert "| 25% | 33% |" in table
    assert "| 2 | differentiates: MissingGradientRule: operator relax.foo" in table
    assert set(PHASES) <= set(table.split("| task | architectures | ")[1].split("\n")[0]
                              .replace(" ", "").split("|"))


class _Units(torch.nn.Module):
    """64 units w * x + b whose sums lie 2^-22 above 0 (a rounding of b's -1 + 2^-22 away),
    through ``activation``; the loss is their sum."""

    def __init__(self, activation):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(64))
        self.b = torch.nn.Parameter(torch.full((64,), -1 + 2.0 ** -22))
        self.activation = activation

    def forward(self, x, labels=None, return_dict=True):
        return SimpleNamespace(loss=self.activation(self.w * x + self.b).sum())


@pytest.mark.parametrize("activation, moves", [(torch.relu, True), (torch.tanh, False)])
def test_pytorchs_own_spread_is_large_where_a_relu_sits_at_a_rounding_from_zero(activation,
                                                                                 moves):
    """A unit a rounding above 0 takes a gradient of 1 or 0 depending on that rounding: 8 ulps
    on the weights move PyTorch's own step by 0.1 (lr 0.1) there, and by 1e-6 through tanh."""
    module, batch = _Units(activation), {"x": torch.ones(64), "labels": torch.zeros(1)}
    state = {k: v.clone() for k, v in module.state_dict().items()}
    _, want_state, _ = _pytorch_step(module, type(module), ["x"], batch)
    spread = _float32_spread(module, type(module), ["x"], batch, state, want_state)
    assert (spread > 0.05) if moves else (spread < 1e-5), spread


@pytest.mark.parametrize("weights, loss, exact, noise", [
    (1e-3, 2.0, 2.0, True),           # weights within twice the spread, the loss PyTorch's
    (1e-5, 2.0003, 2.0002, True),     # the loss off, but closer to float64 than PyTorch's
    (1e-5, 2.0009, 2.0002, False),    # the loss further from float64 than twice PyTorch's
    (1e-5, 2.0003, None, False),      # no float64 loss to tell
    (3e-3, 2.0, 2.0, False)])         # weights beyond twice the spread
def test_noise_is_a_step_no_further_off_than_pytorchs_own_float32(weights, loss, exact, noise):
    """PyTorch's loss here is 2.0 and its spread 1e-3: a compiled step off by no more than
    PyTorch's own float32 rounding explains is noise; anything further is a mismatch."""
    assert _within_noise({"weights": weights, "loss": loss}, 1e-3, 2.0, exact) is noise


@pytest.mark.slow
@pytest.mark.parametrize("mapping, model_type, name", [
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "llama", "LlamaForCausalLM"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "mixtral", "MixtralForCausalLM"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "bert", "BertForSequenceClassification"),
])
def test_a_sample_of_the_zoo_matches_pytorch(tmp_path, mapping, model_type, name):
    record = check(mapping, model_type, name, tmp_path)
    assert record["phase"] == "ok", record
