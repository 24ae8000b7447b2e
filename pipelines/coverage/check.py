"""Model coverage over the transformers zoo: every architecture of transformers' causal-LM,
sequence-classification and image-classification auto mappings, built from a shrunk config
(2 layers, small widths, seeded; nothing downloaded), through the transformers frontend and the
one compile chain, takes one full-BP SGD step that is compared with PyTorch doing the same step
with the class's own loss (``model(..., labels=...).loss``).

Each architecture ends at the first phase it does not pass, with the error's first line:
``config`` (the shrunk model does not build in PyTorch), ``pytorch`` (PyTorch's own step
fails), ``imports`` (export, import or lowering), ``differentiates`` (the training graph),
``builds``, ``steps`` (the compiled step fails), ``matches`` (the loss, every updated weight
within ``RTOL`` of the tensor's scale (plus ``ATOL``), the trained set equal to PyTorch's:
the parameters that get a gradient), ``noise`` (a weight off by more than ``RTOL``, but by no
more than PyTorch's own step moves when its weights move by 8 float32 ulps: a ReLU input a
rounding away from 0 passes or drops its gradient; a loss off, but no further from PyTorch's
float64 loss than twice PyTorch's own float32 loss is), or ``ok``. A causal LM whose class's own
loss does not shift the labels (BART's decoder) is compiled with the per-position loss
(``masked_lm``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

TASKS = {  # auto mapping -> (the step's task, its inputs)
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": ("causal_lm", ["input_ids"]),
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": ("classification", ["input_ids"]),
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": ("classification", ["pixel_values"]),
}
# in order; "crashed": the process died (a segfault) or ran out of time
PHASES = ["config", "pytorch", "imports", "differentiates", "builds", "steps", "matches",
          "noise", "ok", "crashed"]
RTOL, ATOL = 1e-4, 1e-6  # ATOL: float32 noise on a tensor near 0 (a zero-initialised bias
# whose gradient is 0 in exact arithmetic: attention keys' bias)
NUDGE = 2.0 ** -20  # 8 float32 ulps: less than PyTorch's own float32 activations are off
# exact ones (docs/frontends.md, on coverage.md)
# 64 x 64 images and one block per stage (below): at 32 x 32 a ResNet's last stage is 1 x 1,
# its batch norms normalise 2 values, and PyTorch's own float32 step is 39 times a weight's
# scale off its float64 step. 2 a batch: at 8, four image models that match at 2 (Bit,
# MobileNetV1, RegNet, TextNet) are only within noise, and only ResNet gains (its own
# float32 step is 1e-2 off float64 at 2: the table says so beside its mismatch)
BATCH, SEQUENCE, LABELS, IMAGE = 2, 8, 4, 64
# widths and depths of a shrunk config, under the names configs give them
DEPTHS = ["num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers",
          "decoder_layers", "encoder_layers"]
SMALL = {
    **dict.fromkeys(DEPTHS, 2),
    **dict.fromkeys(["hidden_size", "d_model", "n_embd", "dim", "embed_dim",
                     "pooler_hidden_size", "input_embedding_size", "output_embedding_size"],
                    32),  # RemBERT's output embedding: 1664 wide by 250k words at its default
    **dict.fromkeys(["intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim",
                     "encoder_ffn_dim", "hidden_dim", "d_ff", "mamba_d_ssm"], 64),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "num_heads", "mamba_n_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads"], 2),
    "head_dim": 8, "max_position_embeddings": 64, "n_positions": 64,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_intermediate_size": 32,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,  # expert groups: one of all 4
    "image_size": IMAGE,
    "n_groups": 1, "mamba_n_groups": 1,  # Mamba-2's state groups: at most one per head
    "num_kv_shared_layers": 0,  # Gemma 3n's layers reusing others' keys: none to spare at 2
    "window_size": 2,  # Swin's windows: a stage's side (16 to 2 at 64 x 64) a multiple of it
    "rotary_dim": 4,  # CodeGen's and GPT-J's rotary share of a head (8 wide)
    # multi-head latent attention (DeepSeek V2/V3, MiniCPM3): its low ranks and head parts
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8, "index_head_dim": 8, "index_n_heads": 2,
}
# a backbone's chosen stages, named by depth ("stage12"): left to the shrunk depth's default
STAGES = ["out_features", "out_indices"]
TOP_K = ["num_experts_per_tok", "num_experts_per_token"]
STAGE_DEPTHS = ["depths"]  # a vision backbone's blocks per stage: one each
HEADS = ["num_attention_heads", "num_heads"]


def architectures(tasks=TASKS) -> list[tuple[str, str, str]]:
    """(mapping, model type, class name) of every architecture in ``tasks``' auto mappings
    that this transformers has, sorted."""
    import transformers
    from transformers.models.auto import modeling_auto

    found = []
    for mapping in tasks:
        for model_type, name in getattr(modeling_auto, mapping).items():
            if isinstance(name, str) and hasattr(transformers, name):
                found.append((mapping, model_type, name))
    return sorted(found)


def _shrunk(values: dict) -> dict:
    """``values`` (a config's dict) with the keys of SMALL it has set to SMALL's, nested
    configs too (a multimodal model's text config); what is per layer (a list as long as the
    depth, a dict by layer index) cut to the new depth; ``head_dim`` the new width's share of
    the heads; vocabulary and special-token ids kept."""
    # a backbone with blocks per stage (Swin's depths): its num_layers counts the stages,
    # and its lists are per stage, not per layer
    staged = any(isinstance(values.get(k), list) for k in STAGE_DEPTHS)
    depth = None if staged else next(
        (values[k] for k in DEPTHS if isinstance(values.get(k), int)), None)
    out = {}
    for key, value in values.items():
        if depth and isinstance(value, dict) and value and all(
                str(k).isdigit() and int(k) < depth for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < SMALL["num_hidden_layers"]}
        elif isinstance(value, dict) and (key.endswith("config") or "model_type" in value
                                          or any(k in value for k in DEPTHS)):
            out[key] = _shrunk(value)  # a nested config (T5Gemma's "encoder", "decoder")
        elif key in STAGES and depth and "stage_names" not in values:  # layer indices, not
            out[key] = [SMALL["num_hidden_layers"] - 1]  # stages (Data2Vec's): the last one
        elif key in STAGES:
            out[key] = None
        elif key in STAGE_DEPTHS and isinstance(value, list):
            out[key] = [1] * len(value)
        elif key in DEPTHS and staged:
            out[key] = value
        elif key == "hidden_dim" and "width_coefficient" in values:  # EfficientNet's top
            out[key] = value  # conv is 1280 scaled by the width coefficient, not a free width
        elif key in TOP_K and isinstance(value, int):  # no more experts per token than
            out[key] = min(value, SMALL[key])  # the default picks (ZAYA's one)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool):
            out[key] = SMALL[key]
        elif key in SMALL and _ints(value):  # per layer or stage (heads), an image's sides
            out[key] = [SMALL[key]] * (SMALL["num_hidden_layers"] if len(value) == depth
                                       else len(value))
        elif depth and isinstance(value, list) and len(value) == depth:
            out[key] = _first_layers(value, SMALL["num_hidden_layers"])
        else:
            out[key] = value
    heads = next((values[k] for k in HEADS if isinstance(values.get(k), int)), None)
    if "num_key_value_heads" in values and values["num_key_value_heads"] in (None, heads):
        out["num_key_value_heads"] = out.get("num_attention_heads")  # attention without
        # grouped queries stays so (ESMC refuses groups; a None means "as many as heads")
    if values.get("n_routed_experts") and values.get("num_experts_per_tok") is None:
        out["num_experts_per_tok"] = SMALL["num_experts_per_tok"]  # DeepSeek V2's default
    if "max_2d_position_embeddings" in values and "hidden_size" in out:
        out["hidden_size"] = 48  # a layout model's six box embeddings share its width
        out.update({k: 8 for k in ("coordinate_size", "shape_size") if k in values})
    width = out.get("hidden_size")
    for key, value in values.items():  # widths that equal the hidden size follow it
        if key.endswith(("_size", "_dim")) and key not in SMALL and key != "vocab_size" \
                and isinstance(value, int) and value == values.get("hidden_size"):
            out[key] = width  # SqueezeBERT's embedding_size, Dots3's adapter_in_dim
    if {"head_dim", "num_attention_heads"} <= set(out) and width:
        out["head_dim"] = width // out["num_attention_heads"]
    elif {"head_dim", "num_heads", "expand"} <= set(out) and width:  # Mamba-2's mixer:
        out["head_dim"] = width * out["expand"] // out["num_heads"]  # heads x size = expand x width
    if {"d_head", "d_model", "n_head"} <= set(out):  # XLNet's head: its share of d_model
        out["d_head"] = out["d_model"] // out["n_head"]
    if "default_language" in values and values["default_language"] is None \
            and values.get("languages"):
        out["default_language"] = values["languages"][0]  # X-MOD's adapters: one is read
    if {"qk_rope_head_dim", "qk_nope_head_dim"} <= set(out):
        # latent attention: a head's query/key is nope + rope wide, the rotary part is
        # "head_dim"; keys and values come from one latent per head
        out["head_dim"] = out["qk_rope_head_dim"]
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
        out["num_key_value_heads"] = out.get("num_attention_heads")
    if {"mamba_d_head", "mamba_n_heads", "mamba_expand"} <= set(out) and width:
        inner = out.get("mamba_d_ssm") or width * out["mamba_expand"]
        out["mamba_d_head"] = inner // out["mamba_n_heads"]
    if {"mamba_headdim", "n_mamba_heads", "mamba_expand"} <= set(out) and width:  # Zamba2's
        out["mamba_headdim"] = width * out["mamba_expand"] // out["n_mamba_heads"]
    if {"n_input_layers", "n_recurrent_layers", "n_output_layers"} <= set(out):  # Dory's
        out.update(n_input_layers=0, n_recurrent_layers=1, n_output_layers=1)  # parts: the
        # recurrent core and one output layer, as many as the depth
    if isinstance(out.get("layers_block_type"), list) and "attn_layer_period" in out:
        # Zamba ties its first hybrid layer's shared attention to the other hybrids': two
        out["layers_block_type"] = ["hybrid"] * len(out["layers_block_type"])
    if isinstance(out.get("layers_block_type"), list) and "hybrid_layer_ids" in out:
        out["hybrid_layer_ids"] = [i for i, kind in enumerate(out["layers_block_type"])
                                   if kind == "hybrid"]  # Zamba2's, as its kinds were cut
    if {"attention_hidden_size", "attention_head_dim"} <= set(out) and width:  # Zamba2 attends
        out["attention_hidden_size"] = 2 * width  # over its input and the first embeddings
        out["attention_head_dim"] = 2 * width // out["num_attention_heads"]
    return out


def _first_layers(per_layer: list, depth: int) -> list:
    """The first ``depth`` layers' entries, the last ones swapped for kinds of layer that
    would be missing (Qwen3.5's one full-attention layer in four) where there is room."""
    missing = []
    for kind in per_layer:
        if isinstance(kind, str) and kind not in per_layer[:depth] and kind not in missing:
            missing.append(kind)
    missing = missing[:depth - 1]  # the first layer stays
    return per_layer[:depth - len(missing)] + missing


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def tiny_config(model_type: str, num_labels: int = LABELS):
    """The model type's default config, shrunk (SMALL), with ``num_labels`` classes; whether
    it builds is the caller's first check (phase ``config``). Dropout goes off where the
    frontend reads it (frontends/transformers.py)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    values = _shrunk(config.to_dict())
    if "vocab_size" in values and values["vocab_size"] is None:
        values["vocab_size"] = 33  # ESM's default has none: its protein alphabet's
    values["num_labels"] = num_labels
    values.pop("id2label", None), values.pop("label2id", None)
    if values.get("is_encoder_decoder") and values.get("decoder_start_token_id") is None:
        values["decoder_start_token_id"] = values.get("pad_token_id")  # as T5's checkpoints
    return type(config).from_dict(values)


def check(mapping: str, model_type: str, name: str, directory: Path) -> dict:
    """One architecture through the chain and one step against PyTorch's: its record
    {architecture, model_type, task, phase, error}; ``directory`` holds its config and build."""
    import torch

    from pipelines.frontends.transformers import own_loss_task

    task, inputs = TASKS[mapping]
    if inputs == ["pixel_values"] and not _takes(name, "pixel_values"):
        inputs = ["input_ids"]  # ImageGPT classifies images as colour-cluster ids
    record = {"architecture": name, "model_type": model_type, "task": task}
    phase = "config"
    try:
        module, model, cls = _model(model_type, name, task, inputs, directory)
        phase = "pytorch"
        batch = _batch(module, task, inputs)
        if task == "causal_lm":
            own = own_loss_task(module, {n: batch[n] for n in inputs}, batch["labels"])
            if own is None:
                record.update(phase="matches", error="its class's own loss is not cross "
                              "entropy of its logits, shifted or not: a loss no step computes")
                return record
            if own != task:
                model = model.model_copy(update={"task": own})  # the class's own loss
                record["loss"] = "unshifted"
        state = {k: v.clone() for k, v in module.state_dict().items()}
        want_loss, want_state, want_trained = _pytorch_step(module, cls, inputs, batch)
        record.update(phase=_compiled_phase(model, model.task, inputs, batch, directory, state,
                                            want_loss, want_state, want_trained, record))
        if record["phase"] == "matches":  # is it the step, or the model's conditioning?
            off = record.pop("off", None)
            spread = _float32_spread(module, cls, inputs, batch, state, want_state)
            exact, float64 = _float64_step(module, cls, inputs, batch, state, want_state,
                                           want_loss)
            if off is not None and _within_noise(off, spread, want_loss, exact):
                record["phase"] = "noise"
            record["error"] += (f"; PyTorch's own step moves by {spread:.2g} when its weights "
                                f"move by 8 ulps; {float64}")
    except Exception as err:  # the record is the result: the cause, not a crash
        record.update(phase=phase, error=_first_line(err))
    finally:
        torch.set_grad_enabled(True)
    return record


def _compiled_phase(model, task, inputs, batch, directory, state, want_loss, want_state,
                    want_trained, record) -> str:
    from pipelines.compile import build, import_and_lower, optimize, sparse_update, training_graph
    from pipelines.config import SGD
    from pipelines.profiles import load_profile, variant_for
    from pipelines.runtime.step import CompiledStep

    optimizer = SGD(kind="sgd", lr=0.1, momentum=0.0)
    rules, phase = [{"modules": ["*"]}], "imports"
    try:
        lowered = import_and_lower(model, state, seed=0)
        phase = "differentiates"
        full = training_graph(lowered, optimizer, None, 0, task)
        pruned = sparse_update(full, rules, "full")
        optimized = optimize(pruned, True, "never", None, True)
        phase = "builds"
        profile = load_profile("host", {})
        step, planned = optimized.variant(variant_for(optimized.plan, profile))
        (directory / "build").mkdir(parents=True, exist_ok=True)
        built = build(step, planned, profile, directory / "build", None)
        phase = "steps"
        compiled = CompiledStep(built.directory, full.initial)
        loss = compiled.step(*[batch[n].numpy() for n in inputs + ["labels"]])
        after = compiled.state_dict()
    except Exception as err:
        record["error"] = _first_line(err)
        return phase
    names = built.signature["source_names"]
    trained = {names[p] for p in built.signature["trainable"]}
    problems = []
    if trained != want_trained:
        problems.append(f"trains {len(trained)} tensors, PyTorch {len(want_trained)}: "
                        f"{sorted(trained ^ want_trained)[:4]}")
    if not abs(loss - want_loss) <= RTOL * abs(want_loss):
        problems.append(f"loss {loss:.6g}, PyTorch {want_loss:.6g}")
    worst = max(((_error(after[k], v), k) for k, v in want_state.items() if k in after),
                default=(0.0, ""))
    if worst[0] > RTOL:
        problems.append(f"{worst[1]} off by {worst[0]:.2g} of its scale")
    if problems:
        record["error"] = "; ".join(problems)
        if trained == want_trained:  # the numbers alone: PyTorch's own float32 may explain them
            record["off"] = {"weights": worst[0], "loss": loss}
        return "matches"
    return "ok"


def _within_noise(off: dict, spread: float, want_loss: float, exact: float | None) -> bool:
    """Whether the weights are off by no more than twice PyTorch's own spread (8 ulps on its
    weights), and the loss (where it is off) no further from PyTorch's float64 loss than twice
    PyTorch's own float32 loss is."""
    weights = off["weights"] <= RTOL or off["weights"] <= 2 * spread
    loss = abs(off["loss"] - want_loss) <= RTOL * abs(want_loss) or exact is not None and \
        abs(off["loss"] - exact) <= 2 * abs(want_loss - exact)
    return weights and loss


def _model(model_type, name, task, inputs, directory):
    """The shrunk model in PyTorch, seeded, and its model section (a config directory)."""
    import torch
    import transformers
    from pydantic import TypeAdapter

    from pipelines.config import Model

    config = tiny_config(model_type)
    config.architectures = [name]
    text = config.get_text_config()
    if task == "classification" and "input_ids" in inputs and \
            getattr(text, "pad_token_id", None) is None:
        text.pad_token_id = 0  # a classifier reads its last token before the padding, as a
        # tokenizer's config would say (GPT-2's has none); the batch's ids never draw it
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    model = TypeAdapter(Model).validate_python({
        "frontend": "transformers", "source": str(directory.resolve()), "batch_size": BATCH,
        "task": task, "inputs": inputs,
        "dims": {"sequence": SEQUENCE, "image_size": _side(getattr(config, "image_size",
                                                                 IMAGE))}})
    from pipelines.frontends.transformers import class_of, load_module

    torch.manual_seed(0)
    module, _ = load_module(model)
    with torch.no_grad():  # a zero-initialised router (AFMoE's) ties every expert, and which
        for weight in module.parameters():  # tied ones top-k picks is up to the kernel: a
            if weight.ndim >= 2 and not weight.any():  # trained router does not tie
                weight.normal_(0.0, 0.02)
    cls = class_of(model, config)
    assert issubclass(cls, transformers.PreTrainedModel)
    return module, model, cls


def _batch(module, task, inputs) -> dict:
    import torch

    generator = torch.Generator().manual_seed(1)
    config = module.config.get_text_config()
    batch = {}
    if "pixel_values" in inputs:
        size = _side(getattr(config, "image_size", IMAGE))
        batch["pixel_values"] = torch.randn(BATCH, getattr(config, "num_channels", 3), size,
                                            size, generator=generator)
    else:
        vocab = int(getattr(config, "vocab_size", 100) or 100)
        batch["input_ids"] = torch.randint(3, vocab, (BATCH, SEQUENCE), generator=generator)
        eos = getattr(config, "eos_token_id", None)
        if task == "classification" and isinstance(eos, int) and 0 <= eos < vocab:
            batch["input_ids"][:, -1] = eos  # as a tokenizer ends a sentence (BART's
            # classifier reads the hidden state at its end-of-sentence token)
    shape = (BATCH, SEQUENCE) if task == "causal_lm" else (BATCH,)
    high = int(config.vocab_size) if task == "causal_lm" else LABELS
    batch["labels"] = torch.randint(0, high, shape, generator=generator)
    return batch


def _takes(name: str, argument: str) -> bool:
    import inspect

    import transformers

    return argument in inspect.signature(getattr(transformers, name).forward).parameters


def _side(image_size) -> int:
    """An image's side: configs give one int, or height and width (square here)."""
    return image_size if isinstance(image_size, int) else image_size[0]


def _pytorch_step(module, cls, inputs, batch):
    """One SGD step (lr 0.1) with the class's own loss: (loss, state after, names of the
    parameters that got a gradient)."""
    import torch

    output = cls.forward(module, **{n: batch[n] for n in inputs}, labels=batch["labels"],
                         return_dict=True)
    output.loss.backward()
    trained = {n for n, p in module.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return float(output.loss), {k: v.detach().clone() for k, v in module.state_dict().items()}, \
        trained


def _float32_spread(module, cls, inputs, batch, state, want_state, draws: int = 3) -> float:
    """How far PyTorch's own step moves (the worst tensor, as _error measures it) when each
    float weight of ``state`` moves by NUDGE up or down, drawn at random: the float32
    resolution of this model's step, the most of ``draws`` draws. A ReLU whose input is a
    rounding away from 0 passes or drops its gradient on either side of it."""
    import torch

    generator, spread = torch.Generator().manual_seed(0), 0.0
    for _ in range(draws):
        moved = {}
        for key, value in state.items():
            if value.is_floating_point():
                signs = torch.randint(0, 2, value.shape, generator=generator) * 2 - 1
                value = value * (1 + NUDGE * signs)
            moved[key] = value
        module.load_state_dict(moved)
        module.zero_grad(set_to_none=True)
        _, after, _ = _pytorch_step(module, cls, inputs, batch)
        spread = max(spread, *(_error(v, want_state[k]) for k, v in after.items()
                               if v.is_floating_point() and k in want_state))
    return spread


def _float64_step(module, cls, inputs, batch, state, want_state, want_loss
                  ) -> tuple[float | None, str]:
    """PyTorch's step in float64 from ``state``: its loss (None where the model runs in
    float32 only), and how far PyTorch's own float32 step is from it (the worst tensor, as
    _error measures it, and the loss). A model whose float32 step is itself far off cannot
    have a float32 step checked against it at this config."""
    try:
        module.load_state_dict(state)
        module.zero_grad(set_to_none=True)
        module.double()
        wide = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        loss, exact, _ = _pytorch_step(module, cls, inputs, wide)
    except Exception as err:  # some models run in float32 only
        return None, f"PyTorch in float64 fails: {_first_line(err)[:120]}"
    worst = max(((_error(v, exact[k]), k) for k, v in want_state.items()
                 if v.is_floating_point() and k in exact), default=(0.0, ""))
    return loss, (f"PyTorch's own float32 step is off its float64 step by {worst[0]:.2g} "
                  f"({worst[1]}), its loss by {abs(want_loss - loss) / abs(loss):.2g}")


def _error(got, want) -> float:
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return float("inf")
    scale = float(np.abs(want).max(initial=0.0))
    return float(np.abs(got - want).max(initial=0.0)) / (scale + ATOL / RTOL)


def _first_line(err: BaseException) -> str:
    """The error's first line, and the next where the first only announces it ("Compilation
    error:")."""
    lines = [line.strip() for line in f"{type(err).__name__}: {err}".splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text[:300]


def summary(records: list[dict]) -> dict:
    """Counts by task and phase; the share that matches PyTorch, of all and of those whose
    shrunk model PyTorch builds and steps (the others stop before the chain: a default config
    that does not build, inputs or a library the harness lacks)."""
    out = {}
    for task in sorted({r["task"] for r in records}):
        mine = [r for r in records if r["task"] == task]
        counts = {p: sum(r["phase"] == p for r in mine) for p in PHASES}
        running = len(mine) - counts["config"] - counts["pytorch"]
        out[task] = {"architectures": len(mine), **counts,
                     "match_share": round(counts["ok"] / len(mine), 4),
                     "pytorch_steps": running,
                     "match_share_of_pytorch_steps": round(counts["ok"] / max(running, 1), 4)}
    return out

