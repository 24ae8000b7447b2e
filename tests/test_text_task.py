"""The text task: its synthetic sentences, labels and tokens (pipelines/data/sentences.py), the
configuration errors of the cases that fine-tune on it, and one small fine-tuning run of a LoRA
case (pipelines/evaluate/finetune.py: a 2-block MiniLM, batch 8, 16 training sentences, the
case's AdamW; the compiled step's losses within 1e-3 of PyTorch's beside it, its first two
within 1e-4 relative, the export reloaded and scored)."""
import pytest
from conftest import compose_params

from pipelines.config import case_optimizer
from pipelines.schema import ConfigError
from pipelines.data.sentences import NEGATIONS, SPLITS, sentences, tokenize, tokenizer
from pipelines.evaluate.finetune import check_first_losses


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


def test_tokens_are_the_models_vocabulary_with_cls_sep_and_padding():
    ids = tokenize(["the food was good"], 8)
    vocabulary = tokenizer(8)
    assert [vocabulary.id_to_token(int(i)) for i in ids[0]] == [
        "[CLS]", "the", "food", "was", "good", "[SEP]", "[PAD]", "[PAD]"]
    assert ids[0, -1] == 0  # [PAD] is id 0, which MiniLM masks
    with pytest.raises(ConfigError, match="takes 6 tokens; the model's seq_len is 4"):
        tokenize(["the food was good"], 4)


@pytest.mark.parametrize("override, message", [
    ("cases.minilm_lora.model=llama_tiny",
     "cases.minilm_lora.evaluate=['speed', 'finetune'] (from conf/experiment): has finetune, "
     "but model 'llama_tiny' has no fine-tuning task"),
    ("models.minilm.task=regression",
     "cases.minilm_full.evaluate=['speed', 'finetune'] (from conf/experiment): has finetune, "
     "but model 'minilm' has task 'regression' and its "
     "data (kind 'docstrings') labels for ['classification']"),
    ("models.minilm.task=translation", "models.minilm.task='translation'"),
    ("cases.minilm_lora.model=bert", "cases.minilm_lora.model='bert' (from conf/experiment): no such model; allowed: "),
    ("cases.minilm_lora.scheme=minilm_papr", "cases.minilm_lora.scheme='minilm_papr' (from conf/experiment): no such scheme; allowed: "),
    ("cases.minilm_lora.optimizer=lion", "cases.minilm_lora.optimizer='lion' (from conf/experiment): no such optimizer; allowed: "),
    ("models.minilm.finetune.epochs=0",
     ("models.minilm.finetune.epochs=0 (from conf/model/minilm.yaml): Input should be "
      "greater than 0")),
    ("cases.minilm_lora.lr=-1",
     "cases.minilm_lora.lr=-1 (from conf/experiment): Input should be greater than 0"),
    ("models.minilm.data.test_fraction=1",
     ("models.minilm.data.test_fraction=1 (from conf/model/minilm.yaml): Input should be "
      "less than 1")),
])
def test_bad_text_task_settings_are_named(override, message):
    with pytest.raises(ConfigError, match="params.yaml") as err:
        compose_params(override)
    assert message in str(err.value)


@pytest.fixture(scope="module")
def tiny_task():
    """The default experiment with a 2-block MiniLM at batch 8 on the synthetic text task of 16
    training and 24 test sentences (two steps an epoch)."""
    return compose_params("model@models.minilm=minilm_sentences",
                          "models.minilm.kwargs.layers=2", "models.minilm.batch_size=8",
                          "models.minilm.data.train_sentences=16",
                          "models.minilm.data.test_sentences=24")


@pytest.mark.slow
@pytest.mark.parametrize("export", ["separate", "merged"])
def test_a_small_lora_run_fine_tunes_beside_pytorch_and_checks_its_export(tiny_task, build_case,
                                                                          export):
    from pipelines.data import make_data
    from pipelines.evaluate.finetune import finetune

    case = tiny_task.cases["minilm_lora"]
    model, optimizer = tiny_task.models[case.model], case_optimizer(tiny_task, case)
    assert (optimizer.kind, optimizer.lr) == ("adamw", 2e-3)
    lora = tiny_task.schemes[case.scheme].lora.model_copy(update={"export": export})
    compiled = build_case(tiny_task, "minilm_lora", optimizer=optimizer)
    # Two layers x query and value x (A, B) at rank 8 on 384 features, plus the 2-class head.
    assert compiled.report["pruned"]["trainable_elements"] == 2 * 2 * 2 * 8 * 384 + 384 * 2 + 2
    data = make_data(model.data, tiny_task.seed).arrays
    assert data["finetune_train_x"].shape == (16, 32) and data["finetune_test_x"].shape == (24, 32)
    run = finetune(model, compiled.directory, compiled.initial, optimizer, data,
                   model.finetune.epochs, tiny_task.seed, lora, "minilm_lora")
    assert run.metrics["steps"] == 2 and run.metrics["epochs"] == 1
    assert run.metrics["max_abs_loss_difference"] < 1e-3
    assert [r["step"] for r in run.losses] == [1, 2]
    assert [r["epoch"] for r in run.evaluations] == [0, 1]
    # finetune reloaded the export as a user would and checked it scores what the step scored.
    filename, state = run.export
    if export == "merged":
        assert filename == "merged.safetensors"
        assert "classifier.weight" in state and not any(".lora_" in k for k in state)
    else:
        assert filename == "adapters.safetensors"
        assert set(state) == (
            {f"encoder.layer.{b}.attention.self.{p}.lora_{m}.weight" for b in (0, 1)
             for p in ("query", "value") for m in "ab"} | {"classifier.weight", "classifier.bias"})
    # Fewer training sentences than one batch: named, not a silent empty epoch.
    short = {**data, "finetune_train_x": data["finetune_train_x"][:4],
             "finetune_train_y": data["finetune_train_y"][:4]}
    with pytest.raises(ConfigError, match="has 4 training examples, fewer than one step takes"):
        finetune(model, compiled.directory, compiled.initial, optimizer, short, 1, 0, lora)


def test_a_compiled_step_that_strays_from_pytorch_fails_the_run():
    with pytest.raises(RuntimeError, match="first losses .* are not PyTorch's"):
        check_first_losses("full", [0.70, 0.69], [0.70, 0.65])
    check_first_losses("full", [0.70, 0.65], [0.70, 0.65 * (1 + 1e-6)])
