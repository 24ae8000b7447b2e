"""LoRA: rank-r adapters beside chosen projections, added to the lowered graph
(pipelines/training/lora.py) and compiled as an ordinary case of the chain; their PyTorch twin
and exports (pipelines/models/torch_lora.py, pipelines/evaluate/finetune.py: lora_export).

The compiled MiniLM and llama_tiny steps with adapters (the conftest's small models, cases
minilm_lora and llama_lora, with SGD momentum) are checked against PyTorch autograd on the same
adapted model (three chained steps: loss within 1e-5 relative, updated tensors within rtol
1e-4, atol 1e-6, frozen ones bit-identical; tests/chained_steps.py); fresh adapters change
nothing (the step's first loss is the plain model's, within 1e-5). Exports: merged weights give
the adapted model's outputs without adapters (atol 1e-5); separate ones reload to the same
model (exactly). PEFT and transformers are imported without torchao's warnings in the log.
"""
import subprocess
import sys

import numpy as np
import pytest
import torch
from chained_steps import chained_steps_match
from conftest import ROOT, compose_params

from pipelines.config import SGD, LoRA
from pipelines.evaluate.finetune import lora_export
from pipelines.frontends.twin import torch_twin
from pipelines.frontends import load_module
from pipelines.models.pytorch import selection_of
from pipelines.models.torch_lora import (
    adapted_modules,
    adapter_state,
    add_adapters,
    merged_state,
)
from pipelines.runtime.step import CompiledStep
from pipelines.schema import ConfigError
from pipelines.training.lora import add_adapters as add_relax_adapters

# SGD with momentum: Adam divides by the root of tiny second moments, which turns float
# rounding in the adapters' first gradients (A's is zero while B is) into visible differences.
OPT = SGD(kind="sgd", lr=0.05, momentum=0.9, weight_decay=0.0001)
LLAMA_ADAPTED = [f"layers.{b}.attn.{p}" for b in (0, 1) for p in ("q_proj", "v_proj")]


def token_batches(model, classes: bool, count: int = 3):
    rng = np.random.default_rng(0)
    vocab = model.kwargs.get("vocab", 30522)
    shape = (model.batch_size, model.kwargs["seq_len"])
    out = []
    for _ in range(count):
        x = rng.integers(1, vocab, shape)
        y = (rng.integers(0, model.kwargs["num_classes"], shape[0]) if classes
             else rng.integers(0, vocab, shape[0] * shape[1]))
        out.append((x, y))
    return out


@pytest.fixture(scope="module")
def llama(small):
    return small.models["llama_tiny"]


@pytest.fixture(scope="module")
def llama_lowered(llama):
    """The small llama_tiny, lowered (pipelines/phases.py: Lowered)."""
    from pipelines.compile import import_and_lower

    return import_and_lower(llama)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["minilm_lora", "llama_lora"])
def test_compiled_lora_step_matches_pytorch(small, build_case, case):
    """LoRA is an ordinary case of the chain: compile() adds the adapters the scheme names."""
    compiled = build_case(small, case, optimizer=OPT)
    spec = small.cases[case]
    model, lora = small.models[spec.model], small.schemes[spec.scheme].lora
    selection = selection_of(compiled.signature)
    # Only the adapters (and MiniLM's head) train: rank 8 beside query and value of each block.
    adapters = [n for n in selection if ".lora_" in n]
    assert len(adapters) == 2 * 2 * model.kwargs["layers"]
    assert set(selection) - set(adapters) <= {"classifier.weight", "classifier.bias"}
    assert compiled.signature["lora"] == {"rank": 8, "scale": lora.scale}
    batches = token_batches(model, spec.model == "minilm")
    # Fresh adapters (B = 0) change nothing: the step's first loss is the plain model's.
    plain = torch_twin(model, compiled.signature, compiled.initial, adapters=False)
    with torch.no_grad():
        plain_loss = torch.nn.functional.cross_entropy(
            plain(torch.from_numpy(batches[0][0])), torch.from_numpy(batches[0][1])).item()
    assert CompiledStep(compiled.directory, compiled.initial).step(*batches[0]) == (
        pytest.approx(plain_loss, rel=1e-5))
    before, after = chained_steps_match(compiled, model, OPT, batches)
    # The zero-initialised B moved, so the adapters do change the model now.
    b = next(n for n in adapters if n.endswith("lora_b.weight"))
    assert not torch.equal(after[b], before[b])


def adapt(lowered_model, lora, seed):
    """The lowered main with adapters: (main, names table and values by Relax name, both with
    the adapters', and the adapters' names)."""
    main, names, values = lowered_model.main, lowered_model.names, lowered_model.values
    num_params = sum(1 for kind, _ in names.values() if kind == "parameter")
    func, new_names, new_values = add_relax_adapters(main, names, num_params, lora, seed)
    return func, {**names, **new_names}, {**values, **new_values}, new_names


def test_fresh_adapters_change_nothing_and_are_seeded(small, llama, llama_lowered):
    lora = small.schemes["llama_lora"].lora
    main = llama_lowered.main
    func, names, values, new_names = adapt(llama_lowered, lora, seed=3)
    sources = {r: source for r, (_, source) in names.items()}
    assert [s.removesuffix(".lora_a.weight") for _, s in new_names.values()
            if s.endswith(".lora_a.weight")] == LLAMA_ADAPTED
    # A (rank x in) seeded within Kaiming's bound 1/sqrt(in), B (out x rank) zero; both new
    # parameters of main, after the model's own.
    dim = llama.kwargs["dim"]
    for relax_name, (kind, source) in new_names.items():
        assert kind == "parameter"
        value = values[relax_name]
        if source.endswith("lora_a.weight"):
            assert value.shape == (8, dim) and 0 < np.abs(value).max() <= 1 / np.sqrt(dim)
        else:
            assert value.shape == (dim, 8) and not value.any()
    count = int(main.attrs["num_input"])
    assert [p.name for p in func.params] == (
        [p.name for p in main.params] + list(new_names))  # llama_tiny has no buffers
    assert count == int(func.attrs["num_input"])
    # The same seed draws the same adapters; another seed other A's.
    _, _, again, _ = adapt(llama_lowered, lora, seed=3)
    _, _, other, _ = adapt(llama_lowered, lora, seed=4)
    for name in new_names:
        np.testing.assert_array_equal(again[name], values[name])
    a = next(n for n, (_, s) in new_names.items() if s.endswith("lora_a.weight"))
    assert not np.array_equal(other[a], values[a])
    # The PyTorch twin with these fresh adapters computes what the plain model does.
    signature = {"source_names": sources, "lora": {"rank": lora.rank, "scale": lora.scale}}
    adapted = torch_twin(llama, signature, values).eval()
    plain = torch_twin(llama, signature, values, adapters=False).eval()
    assert adapted_modules(adapted.state_dict()) == LLAMA_ADAPTED
    assert not adapted_modules(plain.state_dict())
    x = torch.from_numpy(token_batches(llama, False, 1)[0][0])
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), plain(x), rtol=0, atol=0)


def test_merged_export_equals_the_adapted_model_and_separate_reloads(small, llama):
    lora = small.schemes["llama_lora"].lora
    torch.manual_seed(0)
    model, _ = load_module(llama)
    add_adapters(model.eval(), LLAMA_ADAPTED, lora.rank, lora.scale)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for module in model.modules():
            if hasattr(module, "lora_b"):
                module.lora_a.weight.uniform_(-0.1, 0.1)
                module.lora_b.weight.normal_(0, 0.1)
    x = torch.from_numpy(token_batches(llama, False, 1)[0][0])
    with torch.no_grad():
        want = model(x)
    state = model.state_dict()
    trained = dict.fromkeys([n for n in state if ".lora_" in n] + ["norm.weight"])

    filename, merged = lora_export(state, lora.model_copy(update={"export": "merged"}), trained)
    assert filename == "merged.safetensors"
    assert not any(".lora_" in k for k in merged)
    assert set(merged) == set(merged_state(state, lora.scale))
    torch.manual_seed(1)  # other initial values: the merged state replaces every one
    plain, _ = load_module(llama)
    plain.eval().load_state_dict(merged)  # the plain architecture: no adapters, every key
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)

    filename, separate = lora_export(state, lora, trained)
    assert filename == "adapters.safetensors"
    assert set(separate) == set(trained) == set(adapter_state(state, {"norm.weight"}))
    torch.manual_seed(0)  # the model the adapters were trained from
    reloaded, _ = load_module(llama)
    add_adapters(reloaded.eval(), LLAMA_ADAPTED, lora.rank, lora.scale)
    reloaded.load_state_dict(separate, strict=False)  # the file's values replace the rest
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), want, rtol=0, atol=0)


LORA_FILE = "(from conf/sparse/llama_lora.yaml)"


@pytest.mark.parametrize("override, message", [
    ("schemes.llama_lora.lora.rank=0",
     f"schemes.llama_lora.lora.rank=0 {LORA_FILE}: Input should be greater than 0"),
    ("schemes.llama_lora.lora.alpha=-1",
     f"schemes.llama_lora.lora.alpha=-1 {LORA_FILE}: Input should be greater than 0"),
    ("schemes.llama_lora.lora.modules=[]",
     f"schemes.llama_lora.lora.modules=[] {LORA_FILE}: List should have at least 1 item"),
    ("schemes.llama_lora.lora.export=zip",
     (f"schemes.llama_lora.lora.export='zip' {LORA_FILE}: Input should be 'separate' or "
      "'merged'")),
    ("+schemes.llama_lora.lora.dropout=0.1",
     f"schemes.llama_lora.lora {LORA_FILE}: unknown keys ['dropout']"),
])
def test_bad_lora_sections_are_named(override, message):
    with pytest.raises(ConfigError, match=r"params\.yaml: schemes\.llama_lora\.lora") as err:
        compose_params(override)
    assert message in str(err.value)


def test_a_pattern_no_linear_layer_matches_is_named(llama_lowered):
    with pytest.raises(ConfigError, match=r"lora\.modules: 'layers\.\*\.attn\.qproj' matches no "
                                          r"module with a weight; the model's: .*layers\.0\.attn"
                                          r"\.q_proj"):
        adapt(llama_lowered, LoRA(rank=2, modules=["layers.*.attn.qproj"]), 0)
    # Norms have a weight, but not a linear projection's.
    with pytest.raises(ConfigError, match=r"\['norm'\] are not used as a linear projection's "
                                          r"weight"):
        adapt(llama_lowered, LoRA(rank=2, modules=["norm"]), 0)
    with pytest.raises(ConfigError, match=r"lora\.modules: module pattern 're:\(' is not a "
                                          r"valid regular expression"):
        adapt(llama_lowered, LoRA(rank=2, modules=["re:("]), 0)


TINY_LLAMA = ("t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=1, hidden_size=8, "
              "intermediate_size=8, num_attention_heads=2, num_key_value_heads=2, vocab_size=16))")


@pytest.mark.parametrize("loud, quiet", [
    ("import peft", "from pipelines.models.torch_lora import import_peft; import_peft()"),
    (f"import transformers as t; {TINY_LLAMA}",  # a model's construction imports torchao
     f"from pipelines.frontends.transformers import _library; t = _library(); {TINY_LLAMA}"),
])
def test_peft_and_transformers_are_imported_without_torchaos_warnings(loud, quiet):
    """Where torchao (under peft and transformers' quantizers, installed by executorch) warns
    of kernel libraries this torch cannot load and torch of its enums, the library's imports
    keep them out of the stage's log. Each import in a process of its own: this one may have
    imported them already."""
    def warnings_of(code):
        log = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, check=True).stderr
        return [line for line in log.splitlines() if "Failed to load" in line
                or "_pytree" in line]

    if not warnings_of(loud):
        pytest.skip("a plain import logs no torchao warnings here (torchao absent, or it loads)")
    assert warnings_of(quiet) == []
