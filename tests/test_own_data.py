"""The user's own data (pipelines/data: text, jsonl, csv_file, images) and what a fine-tuned
transformers model goes back as (pipelines/exports).

Fast: each kind's arrays (held out by file or record, rows of seq_len, the prompt masked with
-100), the model directory's tokenizer and chat template, a trained tokenizer the same on every
run, and each bad input named. Slow: a tiny LLaMA as a causal LM, compiled: its loss on masked
chat rows is transformers' own (relative error <= 1e-5); three AdamW steps on a text folder
match PyTorch (loss and every updated weight within 1e-4, frozen ones bit-identical); the
fine-tuned model goes back as a save_pretrained directory with its tokenizer and as a GGUF file
(read by gguf's reader and by transformers), and a LoRA run as a PEFT adapter directory, each
loaded by the library that owns the format and giving the compiled weights' logits within 1e-4.
"""
import json

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_steps_match, model_section

from pipelines.config import LoRA, Adam
from pipelines.data import KINDS, Source, make_data
from pipelines.schema import ConfigError
from pipelines.tasks import IGNORE_INDEX

transformers = pytest.importorskip("transformers")

LLAMA_LM = "tests/frontends/hf/llama_lm"  # LlamaForCausalLM, vocabulary 512: a trained BPE fits
SEQ, BATCH = 32, 2
ADAMW = Adam(kind="adamw", lr=1e-3)
CHATS = [
    {"messages": [{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": "What is 2 plus 3?"},
                  {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "user", "content": "Is 4 even?"},
                  {"role": "assistant", "content": "yes"},
                  {"role": "user", "content": "And 7?"},
                  {"role": "assistant", "content": "no"}]},
    {"prompt": "Q: 3 times 4?\nA:", "completion": " 12"},
    {"text": "plain text is learned whole"},
]


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A checkout whose data/ the kinds read (pipelines/data/files.py: ROOT)."""
    import pipelines.data.files as files

    monkeypatch.setattr(files, "ROOT", tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path


def write_text_folder(root, files: int = 6) -> None:
    """Some of this project's own modules as a user's text folder (real text)."""
    from pathlib import Path

    folder = root / "data" / "notes"
    folder.mkdir(parents=True)
    for i, path in enumerate(sorted(Path("pipelines/data").glob("*.py"))[:files]):
        (folder / f"{i}_{path.stem}.py").write_text(path.read_text())


def write_chats(root, records=CHATS * 4, name: str = "chat.jsonl") -> None:
    (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def kind(cfg: dict):
    return KINDS[cfg["kind"]].Config(**cfg)


def text_cfg(**keys) -> dict:
    return {"kind": "text", "files": "data/notes", "seq_len": SEQ, "vocab_size": 512} | keys


def chat_cfg(**keys) -> dict:
    return {"kind": "jsonl", "files": "data/chat.jsonl", "seq_len": 64, "vocab_size": 300,
            "held_out": 0.25} | keys


def test_text_files_are_packed_into_rows_and_held_out_by_file(root):
    write_text_folder(root)
    made = make_data(kind(text_cfg(held_out=0.3)), 0, Source(vocabulary=512))
    arrays = made.arrays
    assert arrays["finetune_train_x"].shape[1] == SEQ and len(arrays["finetune_test_x"]) > 0
    np.testing.assert_array_equal(arrays["finetune_train_y"], arrays["finetune_train_x"])
    assert arrays["finetune_train_x"].max() < 512
    # two of six files held out, whole: no training row holds a held-out file's text
    assert len(made.files) == 6
    tokenizer = made.tokenizer
    train_text = tokenizer.inner.decode(arrays["finetune_train_x"].ravel().tolist(),
                                        skip_special_tokens=False)
    test_text = tokenizer.inner.decode(arrays["finetune_test_x"].ravel().tolist(),
                                       skip_special_tokens=False)
    held = [p for p in made.files if p.read_text()[:200] in test_text]
    assert len(held) == 2 and not any(p.read_text()[:200] in train_text for p in held)


def test_the_same_files_give_the_same_arrays_and_tokenizer(root, tmp_path_factory):
    write_text_folder(root)
    runs = []
    for _ in range(2):
        made = make_data(kind(text_cfg()), 0, Source(vocabulary=512))
        out = tmp_path_factory.mktemp("tokenizer")
        made.tokenizer.save(out)
        runs.append((made.arrays, (out / "tokenizer.json").read_bytes()))
    (first, tok_a), (second, tok_b) = runs
    assert tok_a == tok_b
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def learned_text(made, split: str = "finetune_train") -> list[str]:
    """Each row's learned tokens (labels not -100), decoded."""
    tokenizer = made.tokenizer.inner
    return [tokenizer.decode([int(t) for t in row if t != IGNORE_INDEX],
                             skip_special_tokens=False) for row in made.arrays[f"{split}_y"]]


def test_only_the_answers_of_chats_and_completions_are_learned(root):
    write_chats(root, CHATS * 2)
    made = make_data(kind(chat_cfg(held_out=0.25)), 0, Source(vocabulary=512))
    learned = set(learned_text(made)) | set(learned_text(made, "finetune_test"))
    # ChatML (the tokenizer has no template): an answer with its end marker; every turn
    assert learned == {"5<|im_end|>\n", "yes<|im_end|>\nno<|im_end|>\n", " 12<|endoftext|>",
                       "plain text is learned whole<|endoftext|>"}
    x, y = made.arrays["finetune_train_x"], made.arrays["finetune_train_y"]
    mask = made.arrays["finetune_train_attention_mask"]
    assert ((y == IGNORE_INDEX) | (y == x)).all() and (y[mask == 0] == IGNORE_INDEX).all()
    everything = make_data(kind(chat_cfg(mask_prompt=False)), 0, Source(vocabulary=512))
    assert any(t.startswith("<|im_start|>system\nAnswer with a number.")
               for t in learned_text(everything) + learned_text(everything, "finetune_test"))


def test_the_model_directory_gives_the_tokenizer_and_chat_template(root, tmp_path_factory):
    from pipelines.data.tokenizer import trained_tokenizer

    directory = tmp_path_factory.mktemp("model")
    own = trained_tokenizer(["some words to learn from"] * 10, 300)
    own.save(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {
        "chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    write_chats(root, CHATS[:2] * 2)
    made = make_data(kind(chat_cfg(vocab_size=None, held_out=0.5, seq_len=128)), 0,
                     Source(directory, 300))  # a character a token: long rows
    assert made.tokenizer.inner.get_vocab() == own.inner.get_vocab()  # the directory's
    assert set(learned_text(made)) | set(learned_text(made, "finetune_test")) == {
        "5\n", "yes\nno\n"}
    # a model whose embedding has fewer rows than the tokenizer has tokens
    with pytest.raises(ConfigError, match=r"finetune_train_x holds token id \d+; the model's "
                                          r"embedding has 40 rows \(its vocab_size\)"):
        make_data(kind(chat_cfg(vocab_size=None, held_out=0.5, seq_len=128)), 0,
                  Source(directory, 40))


def test_csv_rows_become_classes_and_images_are_normalised_as_the_model_says(root):
    from PIL import Image

    lines = ["review,stars"] + [f"\"item {i}, fine\",{i % 3 + 1}" for i in range(20)]
    (root / "data" / "r.csv").write_text("\n".join(lines) + "\n")
    made = make_data(kind({"kind": "csv_file", "files": "data/r.csv", "text_column": "review",
                           "label_column": "stars", "seq_len": 8, "vocab_size": 300}), 0,
                     Source(vocabulary=512))
    arrays = made.arrays
    assert sorted(set(arrays["finetune_train_y"]) | set(arrays["finetune_test_y"])) == [0, 1, 2]
    assert made.classes == ["1", "2", "3"]  # by label: the fine-tuned model's id2label
    assert len(arrays["finetune_train_y"]) == 16 and arrays["finetune_test_x"].shape == (4, 8)
    for name in ("cat", "dog"):
        (root / "data" / "pets" / name).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (6, 4), (255, 0, 0) if name == "cat" else (0, 0, 255)).save(
                root / "data" / "pets" / name / f"{i}.png")
    source = Source(config={"image_size": 4, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    images = make_data(kind({"kind": "images", "files": "data/pets"}), 0, source).arrays
    assert images["finetune_train_x"].shape == (8, 3, 4, 4)
    cat = images["finetune_train_x"][list(images["finetune_train_y"]).index(0)]
    np.testing.assert_allclose(cat[:, 0, 0], [1.0, -1.0, -1.0])  # red, (x - 0.5) / 0.5


CSV = {"kind": "csv_file", "files": "data/r.csv", "text_column": "review", "label_column": "y",
       "seq_len": 8, "vocab_size": 300}


@pytest.mark.parametrize("cfg,write,message", [
    (text_cfg(files="/etc"), None, "data.files='/etc': outside data/"),
    (text_cfg(files="data/none"), None, "data.files='data/none': no such file or folder"),
    (text_cfg(files="data/*.md"), None, "data.files='data/*.md': the glob matches no file"),
    (text_cfg(files="data/one"), "empty", "data.files='data/one': no files in the folder"),
    (text_cfg(files="data/one"), "one", "a held-out split needs at least 2"),
    (text_cfg(files="data/bin"), "binary", "data/bin/b.txt (models.<name>.data.files): not UTF-8"),
    (text_cfg(vocab_size=100000), "text", "vocab_size=100000: a trained byte-level BPE takes"),
    (chat_cfg(), "bad json", "data/chat.jsonl:2: not JSON"),
    (chat_cfg(), "bad keys", "data/chat.jsonl:1: a record needs the keys ['text'] or "
                             "['prompt', 'completion'] or ['messages']"),
    (chat_cfg(), "bad role", "data/chat.jsonl:1: a message is {'role': one of"),
    (chat_cfg(), '{"prompt": "Q", "completion": 5}',
     "data/chat.jsonl:1: 'completion' is int 5; allowed: text (a JSON string)"),
    (chat_cfg(), '{"text": 123}', "data/chat.jsonl:1: 'text' is int 123; allowed: text"),
    (chat_cfg(), '{"messages": [{"role": "user", "content": "hi"}]}',
     "data/chat.jsonl:1: a chat without an assistant turn learns nothing (mask_prompt"),
    (chat_cfg(), '{"messages": "hi"}', "data/chat.jsonl:1: 'messages' is str 'hi'; allowed: a "
                                       "list of messages"),
    ({"kind": "csv_file", "files": "data/r.csv", "text_column": "text", "label_column": "y",
      "seq_len": 8, "vocab_size": 300}, "csv", "data/r.csv: no column 'text'"),
    (CSV, "review,y\nok,1\nbad,\n", "data/r.csv:3: the column 'y' is empty; fill it or remove"),
    (CSV, "review,y\nok,1\n,0\n", "data/r.csv:3: the column 'review' is empty"),
    (CSV, "review,y\nok,1\nbad,0,2\n", "data/r.csv:3: 3 fields where the header has 2"),
    (CSV, 'review,y\n"ok,1\nbad,0\n', "data/r.csv:2: not CSV (unexpected end of data, in the record"),
    ({"kind": "images", "files": "data/flat", "image_size": 4}, "flat",
     "images go in one sub-folder per class"),
])
def test_bad_user_data_is_named(root, cfg, write, message):
    data = root / "data"
    if write == "empty":
        (data / "one").mkdir()
        (data / "one" / "a.bin").write_text("not a text kind's suffix")
    elif write and write.startswith("{"):
        (data / "chat.jsonl").write_text(write + "\n")
    elif write and write.startswith("review,y"):
        (data / "r.csv").write_text(write)
    elif write == "one":
        (data / "one").mkdir()
        (data / "one" / "a.txt").write_text("alone")
    elif write == "binary":
        (data / "bin").mkdir()
        (data / "bin" / "a.txt").write_text("fine")
        (data / "bin" / "b.txt").write_bytes(b"\xff\xfe\x00bad")
    elif write == "text":
        write_text_folder(root, 2)
    elif write == "bad json":
        (data / "chat.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    elif write == "bad keys":
        (data / "chat.jsonl").write_text('{"question": "no"}\n')
    elif write == "bad role":
        (data / "chat.jsonl").write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    elif write == "csv":
        (data / "r.csv").write_text("review,y\nok,1\nbad,0\n")
    elif write == "flat":
        (data / "flat").mkdir()
        from PIL import Image
        Image.new("RGB", (4, 4)).save(data / "flat" / "a.png")
    with pytest.raises(ConfigError) as error:
        make_data(kind(cfg), 0, Source(vocabulary=512))
    assert message in str(error.value)


def test_more_classes_than_the_head_scores_are_named_before_compiling(root, capsys):
    from PIL import Image

    (root / "data" / "r.csv").write_text("review,y\n" + "".join(f"t {i},{i % 3}\n"
                                                                for i in range(9)))
    for name in ("cat", "dog", "fox"):
        (root / "data" / "pets" / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (4, 4)).save(root / "data" / "pets" / name / f"{i}.png")
    head = Source(vocabulary=512, config={"image_size": 4}, classes=2,
                  classes_key="config.num_labels")
    with pytest.raises(ConfigError) as error:
        make_data(kind(CSV), 0, head)
    assert ("data.files='data/r.csv': the column 'y' holds 3 classes ['0', '1', '2']; the "
            "model's head scores 2 (models.<name>.config.num_labels); set it to 3"
            in str(error.value))
    with pytest.raises(ConfigError, match=r"data/pets' \(a class per sub-folder\) holds 3 "):
        make_data(kind({"kind": "images", "files": "data/pets"}), 0, head)
    head.classes = 4  # fewer classes than outputs train, and say so
    assert len(make_data(kind(CSV), 0, head).arrays["finetune_train_y"]) == 7
    assert "3 classes; the model's head scores 4" in capsys.readouterr().out


def test_a_file_linked_into_data_is_read_and_named_where_it_is_linked(root, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "r.csv"
    elsewhere.write_text("review,y\n" + "".join(f"t {i},{i % 2}\n" for i in range(6)))
    (root / "data" / "r.csv").symlink_to(elsewhere)
    made = make_data(kind(CSV), 0, Source(vocabulary=512))
    from pipelines.data.files import relative
    assert [relative(p) for p in made.files] == ["data/r.csv"]


def test_a_model_stage_names_its_model_where_the_library_says_models_name(capsys):
    from pipelines.stage import EXIT_INPUT, run_stage

    def main(name):
        raise ConfigError("models.<name>.data.files='data/x': no such file or folder")

    with pytest.raises(SystemExit) as exited:
        run_stage(main, "reviews", model="reviews")
    assert exited.value.code == EXIT_INPUT
    assert capsys.readouterr().err == ("error: models.reviews.data.files='data/x': no such "
                                       "file or folder\n")


def llama_lm(data: dict, **keys):
    return model_section(frontend="transformers", source=LLAMA_LM, batch_size=BATCH,
                         dims={"sequence": data["seq_len"]}, task="causal_lm", data=data,
                         finetune={"epochs": 1}, **keys)


def logits(module, x) -> torch.Tensor:
    with torch.no_grad():
        out = module(input_ids=torch.from_numpy(x))
    return getattr(out, "logits", out)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= 1e-4, error


@pytest.mark.slow
def test_a_chat_loss_with_the_prompt_masked_is_transformers_own(root, tmp_path, host_profile):
    from pipelines.compile import compile
    from pipelines.frontends import data_source
    from pipelines.frontends.twin import torch_twin
    from pipelines.runtime.step import CompiledStep

    write_chats(root)
    model = llama_lm(chat_cfg(seq_len=SEQ * 2, vocab_size=None))
    made = make_data(model.data, 0, data_source(model))
    x, y = made.arrays["finetune_train_x"][:BATCH], made.arrays["finetune_train_y"][:BATCH]
    assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()
    torch.manual_seed(0)
    compiled = compile(model, [{"modules": ["*"]}], ADAMW, host_profile, tmp_path / "build")
    twin = torch_twin(model, compiled.signature, compiled.initial)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(LLAMA_LM))
    reference.load_state_dict(twin.state_dict())
    with torch.no_grad():
        theirs = reference.train()(input_ids=torch.from_numpy(x),
                                   labels=torch.from_numpy(y)).loss.item()
    ours = CompiledStep(compiled.directory, compiled.initial).step(x, y)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)


@pytest.mark.slow
def test_a_llama_fine_tuned_on_a_text_folder_steps_like_pytorch_and_loads_everywhere(
        root, tmp_path, host_profile):
    """Three AdamW steps on a text folder against PyTorch (loss and every weight within
    1e-4 relative, or 1e-5 absolute: 1% of one step's lr, for an element whose gradient
    cancels to below Adam's eps, e.g. lm_head[2, 0] at 5e-9 where the median is 3e-4, and
    whose update then follows that gradient's rounding in either implementation), then a run fine-tuned by evaluate's code saved as evaluate@ saves it: pretrained/
    with the tokenizer (transformers), model.gguf (gguf's reader, and transformers)."""
    import gguf

    from pipelines.compile import compile
    from pipelines.evaluate.case import save_finetuned
    from pipelines.evaluate.finetune import finetune
    from pipelines.frontends import data_source
    from pipelines.frontends.twin import torch_twin

    write_text_folder(root)
    model = llama_lm(text_cfg(max_rows=3 * BATCH, vocab_size=None))
    made = make_data(model.data, 0, data_source(model))
    xs, ys = made.arrays["finetune_train_x"], made.arrays["finetune_train_y"]
    assert len(xs) == 3 * BATCH and made.tokenizer.inner.get_vocab_size() == 512
    torch.manual_seed(0)
    compiled = compile(model, [{"modules": ["*"]}], ADAMW, host_profile, tmp_path / "build")
    steps = [(xs[i:i + BATCH], ys[i:i + BATCH]) for i in range(0, len(xs), BATCH)]
    before, after = assert_steps_match(compiled, model, ADAMW, steps, rtol=1e-4, atol=1e-5)
    assert all(not torch.equal(before[n], after[n]) for n in after)  # full: everything moved

    run = finetune(model, compiled.directory, compiled.initial, ADAMW, made.arrays, 1, 0)
    assert run.metrics["steps"] == 3 and run.metrics["max_abs_loss_difference"] < 1e-4
    assert run.metrics["perplexity_compiled"] == pytest.approx(
        np.exp(run.metrics["held_out_loss_compiled"]))
    out = tmp_path / "evaluate"
    out.mkdir()
    made.tokenizer.save(tmp_path / "tokenizer")
    save_finetuned(run, model, out, tmp_path / "tokenizer")
    x = made.arrays["finetune_test_x"][:BATCH]
    want = logits(run.step.load_into(torch_twin(model, run.step.signature,
                                                compiled.initial)).eval(), x)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(out / "pretrained")
    assert_logits_close(logits(pretrained.eval(), x), want)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "pretrained")
    assert tokenizer("def main():").input_ids == made.tokenizer.encode("def main():")[0]

    reader = gguf.GGUFReader(out / "model.gguf")
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == 2
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 512
    assert {t.name for t in reader.tensors} >= {"token_embd.weight", "blk.1.attn_q.weight",
                                                "output.weight"}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf")
    assert_logits_close(logits(loaded.eval(), x), want)


@pytest.mark.slow
def test_a_lora_run_goes_back_as_a_peft_adapter_and_merged(root, tmp_path, host_profile):
    peft = pytest.importorskip("peft")

    from pipelines.compile import compile
    from pipelines.evaluate.case import save_finetuned
    from pipelines.evaluate.finetune import finetune
    from pipelines.frontends import data_source
    from pipelines.frontends.twin import torch_twin

    write_chats(root)
    model = llama_lm(chat_cfg(seq_len=SEQ * 2))
    made = make_data(model.data, 0, data_source(model))
    lora = LoRA(rank=4, alpha=8, modules=["*.self_attn.q_proj", "*.self_attn.v_proj"])
    # two batches' gradients a step, against PyTorch accumulating them the same way
    adamw = ADAMW.model_copy(update={"gradient_accumulation_steps": 2})
    torch.manual_seed(0)
    compiled = compile(model, [{"modules": ["*.lora_a", "*.lora_b"], "update": "weight"}],
                       adamw, host_profile, tmp_path / "build", lora=lora)
    run = finetune(model, compiled.directory, compiled.initial, adamw, made.arrays, 1, 0, lora)
    assert run.metrics["steps"] == len(made.arrays["finetune_train_y"]) // (2 * BATCH) >= 2
    assert run.metrics["max_abs_loss_difference"] < 1e-4 * run.losses[0]["pytorch"]
    out = tmp_path / "evaluate"
    out.mkdir()
    made.tokenizer.save(tmp_path / "tokenizer")
    save_finetuned(run, model, out, tmp_path / "tokenizer")
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert config["target_modules"] == [f"model.layers.{i}.self_attn.{p}_proj"
                                        for i in range(2) for p in "qv"]
    assert config["base_model_name_or_path"] == LLAMA_LM
    card = (out / "adapter" / "README.md").read_text()  # the same in every clone
    assert f"base_model: {LLAMA_LM}" in card and str(ROOT) not in card
    x = made.arrays["finetune_test_x"][:BATCH]
    want = logits(run.step.load_into(torch_twin(model, run.step.signature,
                                                compiled.initial)).eval(), x)
    # the source has no weights: the frozen base is saved beside the adapter
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    assert transformers.AutoTokenizer.from_pretrained(out / "base").get_vocab() == \
        made.tokenizer.inner.get_vocab()  # the data's tokenizer beside it
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    assert_logits_close(logits(adapted, x), want)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "pretrained").eval()
    assert_logits_close(logits(merged, x), want)
