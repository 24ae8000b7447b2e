"""Hugging Face transformers models through the transformers frontend (a config.json directory
in tests/frontends/hf/: tiny configs, random init, nothing downloaded) and the one chain
(pipelines/compile.py): LLaMA with grouped-query attention, Qwen2, GPT-2 (tied embeddings,
Conv1D), BERT with an attention mask and token types, ViT, ResNet (batch norm in training mode).

Each family, full BP and a sparse scheme in its own parameter names (the last block's attention
or convolutions, some on half their output channels, and the head): three chained SGD-momentum
steps against PyTorch doing the identical update from the same weights. Tolerance: the loss
within 1e-4 relative at every step, every tensor of the state within rtol 1e-4 / atol 1e-6,
frozen parameters bit-identical (conftest.assert_steps_match).

The same for the other heads, each by its class name (``architecture``) on the same config and
with its task's loss (pipelines/training/loss.py): LLaMA and GPT-2 (head tied to the
embeddings) as causal LMs, BERT as a masked LM and as a regressor (``config: {num_labels: 1}``).
The fine-tuned weights go back as a directory ``from_pretrained`` loads.

Each family also as torch.onnx's default (dynamo) exporter writes it: the step trains the
module's parameters under their state-dict names (pipelines/frontends/onnx_dynamo.py maps the
export's renamed, transposed, merged and dropped ones back), full BP and the same sparse scheme,
against PyTorch's module with the same tolerance.
"""
import numpy as np
import pytest
import torch
from conftest import assert_steps_match, model_section, task_labels

from pipelines.compile import compile
from pipelines.config import SGD
from pipelines.schema import ConfigError
from pipelines.frontends import load_module
from pipelines.models.pytorch import hold_statistics

transformers = pytest.importorskip("transformers")

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9)
BATCH, SEQ = 4, 16
HF = "tests/frontends/hf"
SOURCE = "tests/frontends/hf_models.py"  # the same models as a user's model file
FULL = [{"modules": ["*"]}]
BERT_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]

# family: (the last block's module path, its modules the scheme updates, the head)
SPARSE = {
    "llama": ("model.layers.1", ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"],
              "score"),
    "qwen2": ("model.layers.1", ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"],
              "score"),
    "gpt2": ("transformer.h.1", ["attn.c_attn", "mlp.c_fc"], "score"),
    "bert": ("bert.encoder.layer.1", ["attention.self.query", "intermediate.dense"],
             "classifier"),
    "vit": ("vit.layers.1", ["attention.v_proj", "mlp.fc1"], "classifier"),
    "resnet": ("resnet.encoder.stages.1.layers.0", ["layer.0.convolution",
                                                   "layer.2.convolution"],
               "classifier.1"),
}


def hf_model(family: str, **keys):
    """The family's tests/frontends/hf/ config as a transformers model (BERT with its three
    inputs), ``keys`` on top."""
    return model_section(frontend="transformers", source=f"{HF}/{family}", batch_size=BATCH,
                 dims={"sequence": SEQ, "image_size": 32},
                 inputs=BERT_INPUTS if family == "bert" else [], **keys)


_LOWERED: dict = {}


def lowered(family: str):
    """hf_model(family) imported and lowered (pipelines/compile.py: import_and_lower), once a
    session: its full and sparse steps start from the same lowered model."""
    from pipelines.compile import import_and_lower

    if family not in _LOWERED:
        _LOWERED[family] = import_and_lower(hf_model(family))
    return _LOWERED[family]


def sparse_rules(family: str) -> list[dict]:
    block, modules, head = SPARSE[family]
    first, *rest = [f"{block}.{m}" for m in modules]
    return [{"modules": [head]},
            {"modules": [first], "channels": 0.5, "update": "weight"},
            {"modules": rest}]


def batches(model, count: int = 3) -> list[tuple]:
    """Random batches of the model's inputs, then class labels: token ids above 0 (no pad
    token: a decoder classifier reads each row's last token), each row's mask padded after a
    random length, token types 0 then 1, normal pixels."""
    _, example = load_module(model)
    rng = np.random.default_rng(0)

    def draw(name: str, value: torch.Tensor) -> np.ndarray:
        rows = value.shape[0]
        if name == "input_ids":
            return rng.integers(1, 128, value.shape).astype("int64")
        if name in ("attention_mask", "token_type_ids"):
            cut = rng.integers(SEQ // 4, SEQ, (rows, 1))
            after = np.arange(SEQ)[None, :] >= cut
            return (~after if name == "attention_mask" else after).astype("int64")
        return rng.standard_normal(value.shape).astype("float32")

    return [tuple(draw(n, v) for n, v in example.items()) + (rng.integers(0, 4, BATCH),)
            for _ in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SPARSE))
@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_transformers_model_steps_like_pytorch(tmp_path, host_profile, family, scheme):
    model = hf_model(family)
    torch.manual_seed(0)
    rules = FULL if scheme == "full" else sparse_rules(family)
    compiled = compile(model, rules, OPT, host_profile, tmp_path, scheme_name=scheme,
                       lowered=lowered(family))
    assert compiled.signature["data"] == (BERT_INPUTS if family == "bert" else [
        "pixel_values" if family in ("vit", "resnet") else "input_ids"]) + ["labels"]
    names = compiled.signature["source_names"]
    trainable = {names[p] for p in compiled.signature["trainable"]}
    if scheme == "sparse":
        # the scheme selected by the model's own names: the head, and in the last block only
        # the modules it names
        block, modules, head = SPARSE[family]
        assert any(n.startswith(head + ".") for n in trainable)
        assert {n.rsplit(".", 1)[0] for n in trainable} <= {head} | {
            f"{block}.{m}" for m in modules}
        assert len(compiled.signature["channels"]) >= 1
    else:
        module, _ = load_module(model)
        assert trainable == {name for name, _ in module.named_parameters()}
    before, after = assert_steps_match(compiled, model, OPT, batches(model), rtol=1e-4)
    changed = [n for n in trainable if not torch.equal(before[n], after[n])]
    assert changed, "the step updated nothing"


# name: (family, architecture, config keys, task, the sparse scheme's head or None: full only)
TASK_HEADS = {
    "llama_causal_lm": ("llama", "LlamaForCausalLM", {}, "causal_lm", "lm_head"),
    "gpt2_causal_lm": ("gpt2", "GPT2LMHeadModel", {}, "causal_lm", None),
    "bert_masked_lm": ("bert", "BertForMaskedLM", {}, "masked_lm",
                       "cls.predictions.transform.dense"),
    "bert_regressor": ("bert", "BertForSequenceClassification", {"num_labels": 1},
                       "regression", None)}


@pytest.mark.slow
@pytest.mark.parametrize("head,scheme", [(h, s) for h, spec in TASK_HEADS.items()
                                         for s in ["full"] + ["sparse"] * bool(spec[-1])])
def test_language_model_and_regression_heads_step_like_pytorch(tmp_path, host_profile, head,
                                                                scheme):
    family, architecture, config, task, trained_head = TASK_HEADS[head]
    model = hf_model(family, architecture=architecture, config=config, task=task)
    torch.manual_seed(0)
    rules = FULL
    if scheme == "sparse":
        block, modules, _ = SPARSE[family]
        rules = [{"modules": [trained_head]}, {"modules": [f"{block}.{m}" for m in modules]}]
    compiled = compile(model, rules, OPT, host_profile, tmp_path, scheme_name=scheme)
    rng = np.random.default_rng(0)
    labels = compiled.signature["data_types"]["labels"]["shape"]
    if task == "regression":  # config: {num_labels: 1} took: one score per sequence
        assert labels == [BATCH, 1]
    steps = [b[:-1] + (task_labels(task, labels, rng, 128),) for b in batches(model)]
    before, after = assert_steps_match(compiled, model, OPT, steps, rtol=1e-4)
    names = compiled.signature["source_names"]
    trainable = {names[p] for p in compiled.signature["trainable"]}
    assert [n for n in trainable if not torch.equal(before[n], after[n])], "nothing updated"
    if scheme == "full":
        # back as a checkpoint: from_pretrained loads the fine-tuned weights, ties kept
        from pipelines.frontends.transformers import save_pretrained

        save_pretrained(model, after, tmp_path / "pretrained")
        loaded = getattr(transformers, architecture).from_pretrained(
            tmp_path / "pretrained").state_dict()
        for name, value in after.items():  # a tied head's second name is not the step's
            assert torch.equal(loaded[name], value), name


def onnx_export(module, example: dict, path, **options):
    """``module`` as torch.onnx.export writes it by default (the dynamo exporter, optimized),
    inputs by name, static shapes unless ``options`` give dynamic ones."""
    torch.onnx.export(module, (), path, kwargs=example, dynamo=True, input_names=list(example),
                      output_names=["logits"], **options)
    return path


# family: the parameters the default export folds into constants with other values (frozen)
FOLDED = {"llama": [], "qwen2": [], "gpt2": ["transformer.wpe.weight"],
          "bert": ["bert.embeddings.position_embeddings.weight"],
          "vit": ["vit.embeddings.cls_token"], "resnet": []}


@pytest.fixture(scope="module")
def onnx_exports(tmp_path_factory):
    """family -> (its seeded module exported by torch.onnx's default exporter, that file
    imported and lowered), once a session: its full and sparse steps start from the same."""
    from pipelines.compile import import_and_lower

    made = {}

    def export(family: str):
        if family not in made:
            torch.manual_seed(0)
            module, example = load_module(hf_model(family))
            path = onnx_export(module, example, tmp_path_factory.mktemp("onnx") / f"{family}.onnx",
                               optimize=family != "resnet")
            made[family] = path, import_and_lower(model_section(
                frontend="onnx", source=str(path), batch_size=BATCH, folded="frozen"))
        return made[family]

    return export


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SPARSE))
@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_an_onnx_export_steps_like_pytorch_under_the_state_dict_names(tmp_path, host_profile,
                                                                       onnx_exports, family,
                                                                       scheme):
    """Each family exported to ONNX as torch.onnx writes it by default (ResNet with
    optimize=False: the default folds its batch norm, which is refused): the step's parameters
    are the module's, under its state-dict names (transposed weights, merged and dropped-zero
    parameters mapped back; graph constants never trained), but those the export folded into
    constants (frozen, named). Three steps against PyTorch's module, rtol 1e-4, frozen
    bit-identical."""
    from pipelines.frontends.onnx_graph import frozen_by_export, load_onnx, prepare

    source = hf_model(family)
    path, lowered_export = onnx_exports(family)
    torch.manual_seed(0)
    module, _ = load_module(source)  # as exported: the same seed
    model = model_section(frontend="onnx", source=str(path), batch_size=BATCH, folded="frozen")
    params = {name for name, _ in module.named_parameters()}
    # named at import, with the buffers folded alike (LLaMA's rotary table, BERT's positions)
    assert set(frozen_by_export(prepare(load_onnx(path), BATCH, path))) & params == set(
        FOLDED[family])
    rules = FULL if scheme == "full" else sparse_rules(family)
    compiled = compile(model, rules, OPT, host_profile, tmp_path / "build", scheme_name=scheme,
                       lowered=lowered_export)
    names = compiled.signature["source_names"]
    trainable = {names[p] for p in compiled.signature["trainable"]}
    if scheme == "full":
        assert trainable == params - set(FOLDED[family])
    else:
        block, modules, head = SPARSE[family]
        assert {n.rsplit(".", 1)[0] for n in trainable} <= {head} | {
            f"{block}.{m}" for m in modules}
    assert set(names.values()) <= set(module.state_dict())
    # the batch norms of the layers the scheme freezes (ResNet's) hold their statistics, in both
    hold_statistics(module.train(), compiled.signature["frozen_statistics"])
    before, after = assert_steps_match(compiled, None, OPT, batches(source), rtol=1e-4,
                                       twin=module)
    assert [n for n in trainable if not torch.equal(before[n], after[n])], "nothing updated"


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_folded_parameters_are_refused_naming_them_unless_frozen_is_asked(tmp_path, family):
    """The default export folds GPT-2's and BERT's position embeddings into constants: the
    import names them and the export that keeps them; with folded: frozen it trains the rest;
    exported with optimize=False every parameter is the file's."""
    from pipelines.compile import import_and_lower
    from pipelines.schema import ConfigError

    torch.manual_seed(0)
    module, example = load_module(hf_model(family))
    path = onnx_export(module, example, tmp_path / "default.onnx")
    model = model_section(frontend="onnx", source=str(path), batch_size=BATCH)
    with pytest.raises(ConfigError, match=rf"folded parameters .*{FOLDED[family][0]}.*"
                                          r"optimize=False.*folded: frozen"):
        import_and_lower(model)
    frozen = import_and_lower(model.model_copy(update={"folded": "frozen"}))
    kept = import_and_lower(model_section(
        frontend="onnx", source=str(onnx_export(module, example, tmp_path / "kept.onnx",
                                                optimize=False)), batch_size=BATCH))
    sources = {name for kind, name in kept.names.values() if kind == "parameter"}
    assert sources == {name for name, _ in module.named_parameters()}
    assert FOLDED[family][0] not in {n for k, n in frozen.names.values() if k == "parameter"}


def test_an_export_that_folded_buffers_only_imports_by_default(tmp_path):
    """LLaMA's default export folds its rotary frequencies (a buffer), no parameter."""
    from pipelines.compile import import_and_lower

    torch.manual_seed(0)
    module, example = load_module(hf_model("llama"))
    path = onnx_export(module, example, tmp_path / "default.onnx")
    lowered = import_and_lower(model_section(frontend="onnx", source=str(path), batch_size=BATCH))
    assert {n for k, n in lowered.names.values() if k == "parameter"} == {
        name for name, _ in module.named_parameters()}


def test_an_export_that_folded_batch_norm_is_refused_with_the_export_that_keeps_it(tmp_path):
    from pipelines.frontends.onnx_graph import load_onnx, prepare

    torch.manual_seed(0)
    module, example = load_module(hf_model("resnet"))
    path = onnx_export(module, example, tmp_path / "resnet.onnx")
    with pytest.raises(ConfigError, match=r"resnet\.onnx: the exporter folded batch norm into "
                                          r".*optimize=False"):
        prepare(load_onnx(path), BATCH, path)


@pytest.mark.slow
def test_an_onnx_export_with_dynamic_shapes_takes_them_from_the_config(tmp_path, host_profile):
    """BERT exported with a dynamic batch and sequence length (its shape arithmetic computed
    from them): the batch comes from batch_size, the sequence from dims (by the name the export
    gave it; without it the import names the dimension and the key), the shape arithmetic is
    folded, and the step's first loss is PyTorch's on the same batch."""
    from pipelines.models.pytorch import task_loss
    from pipelines.runtime.step import CompiledStep

    source = hf_model("bert")
    torch.manual_seed(0)
    module, example = load_module(source)
    path = onnx_export(module, example, tmp_path / "dynamic.onnx",
                       dynamic_shapes={n: {0: "batch", 1: "sequence"} for n in example})
    with pytest.raises(ConfigError, match=r"dynamic\.onnx: input 'input_ids' has a dynamic "
                                          r"dimension 'sequence' at axis 1; bind it"):
        compile(model_section(frontend="onnx", source=str(path), batch_size=BATCH), FULL, OPT,
                host_profile, tmp_path / "unbound")
    compiled = compile(model_section(frontend="onnx", source=str(path), batch_size=BATCH,
                             dims={"sequence": SEQ}), FULL, OPT, host_profile, tmp_path / "build")
    batch = batches(source)[0]
    with torch.no_grad():
        want = task_loss("classification", module(*(torch.from_numpy(b) for b in batch[:-1])),
                         torch.from_numpy(batch[-1])).item()
    step = CompiledStep(compiled.directory, compiled.initial)
    assert step.step(*batch) == pytest.approx(want, rel=1e-5)


def test_a_local_pretrained_directory_gives_the_starting_weights(tmp_path):
    """A local from_pretrained directory (config.json and safetensors, as users keep downloaded
    models) as the source: the weights stage starts from its weights, not from a seeded
    initialisation, under the checkpoint's own names."""
    from pipelines.frontends.weights import initial_weights

    torch.manual_seed(1)
    saved = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, pad_token_id=0, num_labels=3))
    saved.save_pretrained(tmp_path / "llama")
    model = model_section(frontend="transformers", source=str(tmp_path / "llama"), batch_size=2,
                  dims={"sequence": 8})
    weights, _ = initial_weights(model, None, seed=0)
    want = saved.state_dict()
    assert weights.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(weights[name], value), name


@pytest.mark.parametrize("keys,error", [
    ({"architecture": "LlamaForTokenMagic"}, r"architecture='LlamaForTokenMagic' is not a "
                                             r"transformers model class; allowed for Llama: "
                                             r"\[.*'LlamaForCausalLM'"),
    ({"config": {"hidden_sizes": 8}}, r"config has keys \['hidden_sizes'\] that LlamaConfig "
                                      r"does not; allowed: \[.*'hidden_size'"),
    ({"inputs": ["pixel_values"]}, r"inputs has \['pixel_values'\]; allowed for "
                                   r"LlamaForSequenceClassification: \['input_ids', "
                                   r"'attention_mask'"),
    ({"dims": {}}, r"dims\.sequence"),
    ({"dims": {"sequence": 65}}, r"dims\.sequence=65 is longer than the model's "
                                 r"max_position_embeddings \(64\); allowed: 1\.\.64"),
    ({"source": "tests/frontends"}, r"tests/frontends: no config\.json"),
])
def test_a_bad_transformers_model_is_named(keys, error):
    model = model_section(**(dict(frontend="transformers", source=f"{HF}/llama", batch_size=2,
                          dims={"sequence": 8}) | keys))
    with pytest.raises(ConfigError, match=error):
        load_module(model)


def test_a_training_step_has_no_dropout_or_stochastic_depth(tmp_path):
    """A step is deterministic: the config's dropout and drop-path rates (CvT's per stage,
    Emu3's in its text model's sub-config) are 0, so the export has no random draw to import."""
    from pipelines.frontends.transformers import config_of

    def config(directory):
        return config_of(model_section(frontend="transformers", source=str(directory),
                                       batch_size=2, dims={"image_size": 32},
                                       inputs=["pixel_values"]))

    transformers.AutoConfig.for_model("cvt", drop_path_rate=[0.0, 0.1, 0.2],
                                      attention_drop_rate=[0.1] * 3).save_pretrained(tmp_path)
    cvt = config(tmp_path)
    assert cvt.drop_path_rate == cvt.attention_drop_rate == [0.0] * 3
    emu3 = transformers.AutoConfig.for_model("emu3")
    assert emu3.text_config.attention_dropout == 0.1
    emu3.save_pretrained(tmp_path / "emu3")
    assert config(tmp_path / "emu3").text_config.attention_dropout == 0.0


def test_num_labels_set_over_a_config_with_other_labels_replaces_them():
    """config.num_labels on a directory whose id2label has another length: the head has that
    many outputs, and transformers is not left to warn that the two disagree."""
    import logging

    from pipelines.frontends.transformers import config_of

    assert len(transformers.AutoConfig.from_pretrained(f"{HF}/bert").id2label) != 3
    warnings, handler = [], logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)  # it does not propagate to root
    try:
        config = config_of(model_section(frontend="transformers", source=f"{HF}/bert",
                                         batch_size=2, config={"num_labels": 3}))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert config.num_labels == 3 and sorted(config.id2label) == [0, 1, 2]
    assert not [w for w in warnings if "incompatible" in w]


def test_transformers_keys_belong_to_the_transformers_frontend():
    """Each frontend's section has its own keys (pipelines/frontends: each Config)."""
    with pytest.raises(ValueError, match=r"unknown keys \['architecture'\]; allowed: \[.*'entry'"):
        model_section(frontend="torch", source=SOURCE, entry="bert_classifier", batch_size=2,
                      architecture="BertModel")
    with pytest.raises(ValueError, match=r"unknown keys \['entry'\]; allowed: \[.*'architecture'"):
        model_section(frontend="transformers", source=f"{HF}/bert", entry="build", batch_size=2)


@pytest.mark.slow
def test_bert_fine_tunes_on_text_data_with_its_inputs_bound_by_name(tmp_path, host_profile):
    """BERT's three inputs bound from the text task's columns by name (x: token ids, then
    attention_mask with its [PAD] positions masked, token_type_ids): two fine-tuning steps,
    the compiled step's losses PyTorch's within 1e-4, and the fine-tuned model back as a
    from_pretrained directory."""
    from pipelines.data.sentences import Config as Sentences
    from pipelines.data import make_data
    from pipelines.evaluate.finetune import finetune
    from pipelines.frontends.transformers import save_pretrained

    data_cfg = Sentences(kind="sentences", seq_len=SEQ, train_sentences=8, test_sentences=8)
    model = hf_model("bert", data=data_cfg, config={"vocab_size": 30522, "num_labels": 2})
    data = make_data(data_cfg, 0).arrays
    assert (data["finetune_train_attention_mask"] == 0).any()  # padded sentences
    torch.manual_seed(0)
    compiled = compile(model, FULL, OPT, host_profile, tmp_path / "build")
    run = finetune(model, compiled.directory, compiled.initial, OPT, data, 1, 0)
    assert run.metrics["steps"] == 2
    assert run.metrics["max_abs_loss_difference"] < 1e-4 * run.losses[0]["pytorch"]
    save_pretrained(model, run.plain_weights, tmp_path / "pretrained", ["negative", "positive"])
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "pretrained")
    assert torch.equal(loaded.classifier.weight, run.weights["classifier.weight"])
    # the data's class names, so that a pipeline's predictions are named
    assert loaded.config.id2label == {0: "negative", 1: "positive"}
    assert loaded.config.label2id == {"negative": 0, "positive": 1}


def test_a_model_input_the_data_lacks_is_named():
    from pipelines.data import split

    data = {"train_x": np.zeros((4, 8)), "train_y": np.zeros(4),
            "train_attention_mask": np.ones((4, 8))}
    xs, _ = split(data, "train", ["input_ids", "attention_mask"])
    assert [a.tolist() for a in xs] == [data["train_x"].tolist(),
                                        data["train_attention_mask"].tolist()]
    with pytest.raises(ConfigError, match=r"inputs \['input_ids', 'token_type_ids'\] need the "
                                          r"columns \['train_token_type_ids'\]; this data has "
                                          r"\['attention_mask'\]"):
        split(data, "train", ["input_ids", "token_type_ids"])


@pytest.mark.parametrize("scheme, head", [("transformer_paper", set()), (
    "transformer_paper_head", {"model.embed_tokens.weight", "model.norm.weight"})])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_paper_transformer_scheme_selects_by_the_checkpoint_names(family, scheme, head):
    """conf/sparse/transformer_paper.yaml on transformers' own names, its blocks found from
    them (model.layers.N): the attention projections and the first FFN linears of the last
    two blocks; transformer_paper_head.yaml adds the LM head (the tied embedding) and the
    final norm."""
    import yaml

    from pipelines.frontends.layers import describe_layers
    from pipelines.io import ROOT
    from pipelines.training.scheme import select

    module, _ = load_module(hf_model(family, config={"num_hidden_layers": 3}))
    layers = describe_layers(module)
    assert layers["blocks"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    rules = yaml.safe_load((ROOT / f"conf/sparse/{scheme}.yaml").read_text())["rules"]
    selected = select(rules, layers)
    assert set(selected) == head | {f"model.layers.{b}.{m}.weight" for b in (1, 2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj")}


def test_blocks_are_found_from_numbered_module_paths():
    from pipelines.frontends.layers import repeated_blocks

    assert repeated_blocks(["embed", "enc.layer.0.attn", "enc.layer.0.ffn.0", "enc.layer.1.attn",
                            "enc.layer.1.ffn.0", "head.1"]) == ["enc.layer.0", "enc.layer.1"]
    assert repeated_blocks(["conv1", "fc"]) == []


def test_a_model_file_wrapping_transformers_is_the_same_model_under_a_prefix():
    """The model-file route (frontend torch, tests/frontends/hf_models.py wrapping BERT) and
    the transformers frontend give the same module: the file's names carry the wrapper's
    ``model.`` prefix, and with the same weights the logits are the same."""
    torch.manual_seed(0)
    wrapped, example = load_module(model_section(frontend="torch", source=SOURCE,
                                         entry="bert_classifier", batch_size=BATCH))
    module, own = load_module(hf_model("bert"))
    assert list(example) == list(own) == BERT_INPUTS
    state = wrapped.state_dict()
    assert sorted(state) == sorted(f"model.{k}" for k in module.state_dict())
    module.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        torch.testing.assert_close(wrapped.eval()(**example), module.eval()(**example),
                                   rtol=0, atol=0)
