"""The code language model's data and pre-training (pipelines/data/python_sources.py,
pipelines/frontends/weights.py): standard-library packages to pre-train on and others to
fine-tune on, split by file, a BPE trained on the pre-training files; a causal LM pre-trained on
them and read by held-out perplexity. The compiled fine-tuning steps are the text kind's
(tests/test_own_data.py); experiment=code_lm's figures are measured outside CI (docs/llm.md)."""
import math

import numpy as np
import pytest
from conftest import compose_params, model_section

from pipelines.data import Source, make_data
from pipelines.schema import ConfigError

pytest.importorskip("transformers")

SEQ = 32
DATA = {"kind": "python_sources", "pretrain_packages": ["json", "tomllib"],
        "finetune_packages": ["html", "wsgiref"], "seq_len": SEQ, "vocab_size": 512}


def tiny_lm(**data):
    """A 2-layer LLaMA (vocabulary 512) on the packages, pre-trained one epoch with AdamW."""
    return model_section(frontend="transformers", source="tests/frontends/hf/llama_lm",
                         task="causal_lm", batch_size=4, dims={"sequence": SEQ},
                         data={**DATA, **data},
                         pretrain={"epochs": 1, "batch_size": 8, "lr": 3e-3, "kind": "adamw"})


def test_each_part_is_split_by_file_and_tokenized_by_a_bpe_of_the_pretraining_files():
    made = make_data(tiny_lm().data, 0, Source(vocabulary=512))
    arrays = made.arrays
    for name in ("pretrain_train", "pretrain_test", "finetune_train", "finetune_test"):
        rows = arrays[f"{name}_x"]
        assert rows.shape[1] == SEQ and len(rows) > 0
        assert (arrays[f"{name}_y"] == rows).all() and arrays[f"{name}_attention_mask"].all()
        assert rows.max() < 512
    assert {f.parent.name for f in made.files} >= {"json", "tomllib", "html", "wsgiref"}
    assert made.tokenizer.inner.get_vocab_size() == 512
    again = make_data(tiny_lm().data, 0, Source(vocabulary=512)).arrays
    assert all((again[k] == v).all() for k, v in arrays.items())  # reproducible
    capped = make_data(tiny_lm(max_rows=3).data, 0, Source(vocabulary=512)).arrays
    assert len(capped["pretrain_train_x"]) == len(capped["finetune_train_x"]) == 3


@pytest.mark.parametrize("change, message", [
    ({"finetune_packages": ["json"]}, r"\['json'\] in both pretrain_packages and"),
    ({"finetune_packages": ["nonsense"]}, r"finetune_packages has \['nonsense'\].*allowed"),
])
def test_bad_packages_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        make_data(tiny_lm(**change).data, 0, Source(vocabulary=512))


def test_a_language_model_is_pretrained_and_read_by_perplexity():
    import torch

    from pipelines.frontends.weights import initial_weights

    model = tiny_lm(max_rows=64)
    data = make_data(model.data, 0, Source(vocabulary=512)).arrays
    state, metrics = initial_weights(model, data, seed=0)
    assert metrics["pretrain_test_perplexity"] == pytest.approx(
        math.exp(metrics["pretrain_test_loss"]))
    assert metrics["pretrain_test_perplexity"] < 450  # a uniform guess: 512; after 8 steps ~375
    assert np.isfinite(metrics["pretrain_final_loss"])
    assert "model.embed_tokens.weight" in state
    again, _ = initial_weights(model, data, seed=0)  # the same weights on every run
    assert all(torch.equal(again[k], v) for k, v in state.items())


def test_the_experiment_composes():
    params = compose_params("experiment=code_lm")
    assert {c.scheme for c in params.cases.values()} == {"full", "transformer_paper",
                                                          "transformer_paper_head", "lora"}
    model = params.models["code"]
    assert not set(model.data.pretrain_packages) & set(model.data.finetune_packages)


def test_a_tied_head_is_loaded_with_the_embeddings_it_shares():
    """The step holds a tied weight under one name; loading it into the PyTorch model (to
    score it) fills the other name too, and a value the step lacks is still an error."""
    from types import SimpleNamespace

    import torch

    from pipelines.runtime.step import CompiledStep

    model = torch.nn.Module()
    model.embed, model.head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    value = torch.arange(8.0).reshape(4, 2)
    step = SimpleNamespace(state_dict=lambda: {"embed.weight": value})
    CompiledStep.load_into(step, model)
    assert torch.equal(model.head.weight, value)
    model.norm = torch.nn.LayerNorm(2)
    with pytest.raises(KeyError, match="norm.weight"):
        CompiledStep.load_into(step, model)
