"""The text task (stages/text_task): its synthetic sentences, labels and tokens, its
configuration errors, and one small run of the stage (a 2-block MiniLM, LoRA, a few steps:
the compiled step's first losses checked against PyTorch's, the export reloaded and scored)."""

import json

import pytest
import torch

import stages.text_task.__main__ as stage
from pipelines.config import ConfigError, load_profile
from stages.text_task.data import (NEGATIONS, SPLITS, load_vocab, sentences, tokenize)


def oracle(text: str) -> int:
    """The label by reading the sentence: the clause after "but" decides; a negation flips."""
    clause = text.split(" but ")[-1].split()
    positive = {w for pos, _, _ in SPLITS.values() for w in pos}
    negative = {w for _, neg, _ in SPLITS.values() for w in neg}
    (word,) = [w for w in clause if w in positive | negative]
    return int(word in positive) ^ int(any(w in NEGATIONS for w in clause))


def test_sentences_are_seeded_and_labelled_by_their_words():
    texts, labels = sentences("train", 300, seed=0)
    again, again_labels = sentences("train", 300, seed=0)
    assert again == texts and again_labels.tolist() == labels.tolist()
    assert sentences("train", 300, seed=1)[0] != texts
    assert [oracle(t) for t in texts] == labels.tolist()
    assert 0.4 < labels.mean() < 0.6
    assert any(" but " in t for t in texts) and any(" not " in t for t in texts)


def test_test_sentences_use_words_no_training_sentence_has():
    train = {w for t in sentences("train", 2000, 0)[0] for w in t.split()}
    test_texts, test_labels = sentences("test", 500, 0)
    positive, negative, things = SPLITS["test"]
    assert not train & set(positive + negative + things)
    assert [oracle(t) for t in test_texts] == test_labels.tolist()


def test_tokens_are_vocabulary_lines_with_cls_sep_and_padding():
    vocab = load_vocab()
    ids = tokenize(["the food was good"], 8, vocab)
    words = {i: w for w, i in vocab.items()}
    assert [words[i] for i in ids[0]] == ["[CLS]", "the", "food", "was", "good", "[SEP]",
                                          "[PAD]", "[PAD]"]
    with pytest.raises(ConfigError, match="takes 6 tokens; model.seq_len is 4"):
        tokenize(["the food was good"], 4, vocab)
    with pytest.raises(ConfigError, match=r"\['yummy'\] are not whole tokens"):
        tokenize(["the food was yummy"], 8, vocab)


TASK = {"model": "minilm", "schemes": ["minilm_lora"], "optimizer": "adamw",
        "lr": {"minilm_lora": 1e-3},
        "epochs": 1, "train_sentences": 16, "test_sentences": 24}


@pytest.mark.parametrize("change, message", [
    ({"model": "llama_tiny"}, "text_task.model='llama_tiny' is a llama model; allowed: an "
                              "encoder with a classification head"),
    ({"model": "bert"}, "text_task.model names 'bert'; allowed: "),
    ({"schemes": ["minilm_papr"]}, "text_task.schemes names 'minilm_papr'; allowed: "),
    ({"schemes": []}, "text_task.schemes must list conf/sparse schemes"),
    ({"optimizer": "lion"}, "text_task.optimizer names 'lion'; allowed: "),
    ({"epochs": 0}, "text_task.epochs=0; allowed: an integer >= 1"),
    ({"schemes": ["full", "minilm_lora"]}, "allowed: a learning rate per scheme, for each of "
                                           "['full', 'minilm_lora']"),
    ({"lr": {"minilm_lora": -1}}, "text_task.lr.minilm_lora=-1; allowed: a number > 0"),
    ({"train_sentences": 4}, "text_task.train_sentences=4 is less than one batch"),
])
def test_bad_text_task_settings_are_named(change, message):
    with pytest.raises(ConfigError, match="params.yaml") as err:
        stage.load_task({"text_task": dict(TASK, **change), "seed": 0})
    assert message in str(err.value)


@pytest.mark.parametrize("export", ["separate", "merged"])
def test_a_small_lora_run_writes_metrics_curves_and_a_checked_export(tmp_path, monkeypatch,
                                                                      export):
    small = {"name": "minilm", "arch": "minilm", "layers": 2, "num_classes": 2, "seq_len": 32,
             "batch_size": 8, "pretrained": True}
    real = stage.load_conf_entry

    def load(group, name, key):
        entry = real(group, name, key)
        if group == "model":
            return small
        if group == "sparse":
            entry["lora"]["export"] = export
        return entry

    monkeypatch.setattr(stage, "load_conf_entry", load)
    monkeypatch.setattr(stage, "load_params", lambda: {"text_task": TASK, "seed": 0})
    monkeypatch.setattr(stage, "OUT", tmp_path / "text_task")
    # The host profile from its file: a clean checkout has no artifacts/profiles yet.
    monkeypatch.setattr(stage, "resolved_profile", lambda name: load_profile(name, {}))
    stage.main()
    metrics = json.loads((tmp_path / "text_task" / "metrics.json").read_text())
    row = metrics["schemes"]["minilm_lora"]
    assert metrics["train_sentences"] == 16 and row["steps"] == 2
    assert metrics["data"].startswith("synthetic")
    # Two layers x query and value x (A, B) at rank 8 on 384 features, plus the 2-class head.
    assert row["trainable_elements"] == 2 * 2 * 2 * 8 * 384 + 384 * 2 + 2
    assert row["max_abs_loss_difference"] < 1e-3
    curve = json.loads((tmp_path / "text_task" / "loss.json").read_text())
    assert [r["step"] for r in curve] == [1, 2]
    exported = tmp_path / "text_task" / "exports" / "minilm_lora"
    if export == "merged":
        state = torch.load(exported / "weights.pt", weights_only=True)
        assert "classifier.weight" in state and not any(".lora_" in k for k in state)
    else:
        payload = torch.load(exported / "adapter.pt", weights_only=True)
        assert payload["lora"]["rank"] == 8
        assert set(payload["state"]) == (
            {f"encoder.layer.{b}.attention.self.{p}.lora_{m}.weight" for b in (0, 1)
             for p in ("query", "value") for m in "ab"} | {"classifier.weight", "classifier.bias"})


def test_a_compiled_step_that_strays_from_pytorch_fails_the_stage():
    with pytest.raises(SystemExit, match="first losses .* are not PyTorch's"):
        stage.check_first_losses("full", [(0.70, 0.70), (0.69, 0.65)])
    stage.check_first_losses("full", [(0.70, 0.70), (0.65, 0.65 * (1 + 1e-6))])
