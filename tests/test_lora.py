"""LoRA (pipelines/lora.py): rank-r adapters beside chosen projections, through the compiler.

The compiled MiniLM and llama_tiny steps with adapters are checked against PyTorch autograd on
the same adapted model (three chained steps: loss within 1e-5 relative, updated tensors within
rtol 1e-4, atol 1e-6, frozen ones bit-identical). Exports: merged weights give the adapted
model's outputs without adapters (atol 1e-5); separate ones reload to the same model.
"""

import numpy as np
import pytest
import torch
import tvm
import yaml

from conftest import chained_steps_match
from pipelines.config import CONF, ConfigError
from pipelines.lora import adapter_state, add_adapters, check_lora, merged_state
from pipelines.models import build_model
from pipelines.step import save_step
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MINILM = {"name": "minilm_test", "arch": "minilm", "layers": 2, "num_classes": 3,
          "seq_len": 16, "batch_size": 2, "pretrained": True}
LLAMA = {"name": "llama_test", "arch": "llama", "vocab": 64, "dim": 32, "layers": 2,
         "heads": 2, "hidden": 48, "seq_len": 8, "batch_size": 2}
# SGD with momentum: Adam divides by the root of tiny second moments, which turns float
# rounding in the adapters' first gradients (A's is zero while B is) into visible differences.
OPT = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0001}


def scheme(name: str) -> dict:
    return yaml.safe_load((CONF / "sparse" / f"{name}.yaml").read_text())


def token_batches(model: dict, classes: bool, count: int = 3):
    rng = np.random.default_rng(0)
    vocab = 30522 if model["arch"] == "minilm" else model["vocab"]
    shape = (model["batch_size"], model["seq_len"])
    out = []
    for _ in range(count):
        x = rng.integers(1, vocab, shape)
        y = (rng.integers(0, model["num_classes"], shape[0]) if classes
             else rng.integers(0, vocab, shape[0] * shape[1]))
        out.append((x, y))
    return out


@pytest.mark.parametrize("model, name", [(MINILM, "minilm_lora"), (LLAMA, "llama_lora")],
                         ids=["minilm_lora", "llama_lora"])
def test_compiled_lora_step_matches_pytorch(tmp_path, model, name):
    lora_scheme = scheme(name)
    layers, full, signature = full_step(model, OPT, lora_scheme["lora"], 0)
    selection = select(lora_scheme, layers)
    # Only the adapters (and MiniLM's head) train: rank 8 beside query and value of each block.
    adapters = [n for n in selection if ".lora_" in n]
    assert len(adapters) == 2 * 2 * model["layers"]
    assert set(selection) - set(adapters) <= {"classifier.weight", "classifier.bias"}
    pruned, sig, _ = sparse_step(full, signature, selection)
    sig = dict(sig, scheme=name)
    save_step(optimize(pruned, sig, reorder=True), sig, tvm.target.Target({"kind": "llvm"}),
              tmp_path)
    before, after = chained_steps_match(tmp_path, model, OPT, selection, sig,
                                        token_batches(model, model["arch"] == "minilm"),
                                        lora=lora_scheme["lora"])
    # The zero-initialised B moved, so the adapters do change the model now.
    b = next(n for n in adapters if n.endswith("lora_b.weight"))
    assert not torch.equal(after[b], before[b])


def test_fresh_adapters_change_nothing_and_are_seeded():
    torch.manual_seed(0)
    plain = build_model(LLAMA).eval()
    x = torch.from_numpy(token_batches(LLAMA, False, 1)[0][0])
    want = plain(x)
    lora = scheme("llama_lora")["lora"]
    adapted = add_adapters(plain, lora, seed=3)
    assert adapted == [f"layers.{b}.attn.{p}" for b in (0, 1) for p in ("q_proj", "v_proj")]
    torch.testing.assert_close(plain(x), want, rtol=0, atol=0)  # B starts at zero
    torch.manual_seed(0)
    again = build_model(LLAMA)
    add_adapters(again, lora, seed=3)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]), name
    other = build_model(LLAMA)
    add_adapters(other, lora, seed=4)
    assert not torch.equal(other.layers[0].attn.q_proj.lora_a.weight,
                           plain.layers[0].attn.q_proj.lora_a.weight)


def test_merged_export_equals_the_adapted_model_and_separate_reloads():
    torch.manual_seed(0)
    lora = dict(scheme("llama_lora")["lora"], export="merged")
    model = build_model(LLAMA).eval()
    add_adapters(model, lora, seed=0)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for module in model.modules():
            if hasattr(module, "lora_b"):
                module.lora_b.weight.normal_(0, 0.1)
    x = torch.from_numpy(token_batches(LLAMA, False, 1)[0][0])
    want = model(x)
    merged = merged_state(model.state_dict(), lora)
    assert not any(".lora_" in k for k in merged)
    plain = build_model(LLAMA).eval()
    plain.load_state_dict(merged)  # the plain architecture: no adapters, every key
    torch.testing.assert_close(plain(x), want, rtol=1e-5, atol=1e-5)

    separate = adapter_state(model.state_dict(), trained={"norm.weight"})
    assert set(separate) == ({n for n in model.state_dict() if ".lora_" in n}
                             | {"norm.weight"})
    torch.manual_seed(0)
    reloaded = build_model(LLAMA).eval()
    add_adapters(reloaded, lora, seed=1)  # another seed: the file's values replace them
    reloaded.load_state_dict(separate, strict=False)
    torch.testing.assert_close(reloaded(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("lora, message", [
    ({"rank": 0, "modules": ["x"]}, "rank=0; allowed: an integer >= 1"),
    ({"rank": 4, "alpha": -1, "modules": ["x"]}, "alpha=-1; allowed: a number > 0"),
    ({"rank": 4, "modules": []}, "modules=[]; allowed: a non-empty list"),
    ({"rank": 4, "modules": ["re:("]}, "not a valid regular expression"),
    ({"rank": 4, "modules": ["x"], "export": "zip"}, "export='zip'; allowed: separate, merged"),
    ({"rank": 4, "modules": ["x"], "dropout": 0.1}, "unknown keys ['dropout']"),
])
def test_bad_lora_sections_are_named(lora, message):
    with pytest.raises(ConfigError, match=r"conf/sparse/x.yaml: lora") as err:
        check_lora(lora, "conf/sparse/x.yaml: lora")
    assert message in str(err.value)


def test_a_pattern_matching_no_linear_layer_is_named():
    model = build_model(LLAMA)
    with pytest.raises(ConfigError, match=r"'layers.\*.attn.qproj' matches no linear layer of "
                                          r"the model; its linear layers: layers.0.attn.q_proj"):
        add_adapters(model, {"rank": 2, "modules": ["layers.*.attn.qproj"]}, 0)
    # Norms are not linear layers.
    with pytest.raises(ConfigError, match="matches no linear layer"):
        add_adapters(model, {"rank": 2, "modules": ["norm"]}, 0)


def test_the_main_pipeline_refuses_a_lora_scheme(monkeypatch):
    import stages.prune.__main__ as prune

    monkeypatch.setattr(prune, "load_params", lambda: {"sparse": scheme("minilm_lora")})
    with pytest.raises(ConfigError, match="sparse='minilm_lora' is a LoRA scheme .*text_task"):
        prune.main()
