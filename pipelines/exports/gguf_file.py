"""A fine-tuned LLaMA or Qwen2 causal LM as a GGUF file, laid out as llama.cpp's
convert_hf_to_gguf.py writes one (fp32): the config as ``<arch>.*`` keys, the tensors under
the names the ``gguf`` package maps transformers' to (``blk.0.attn_q.weight``), LLaMA's query
and key rows permuted into llama.cpp's rotary layout, and the tokenizer (a byte-level BPE:
``tokenizer.ggml.model`` gpt2, its tokens padded to the embedding's rows, merges, special ids,
chat template). llama.cpp loads it, and so does transformers
(``from_pretrained(directory, gguf_file=...)``), which undoes the permutation.

The head is always written (``output.weight``), tied embeddings or not: both readers then take
it as it is.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipelines.schema import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a LLaMA query or key projection from transformers' rotary layout (halves) to
    llama.cpp's (pairs), as convert_hf_to_gguf.py's LlamaModel.permute does."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def tokens(tokenizer: Path, rows: int) -> tuple[list[str], list[int]]:
    """The tokenizer's tokens by id and their GGUF types (special: control), padded to
    ``rows`` (the embedding's) with unused [PAD<i>] tokens."""
    import gguf

    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    model = spec["model"]
    if model["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ConfigError(f"{tokenizer}: a {model['type']} tokenizer; the GGUF export writes "
                          "byte-level BPE tokenizers (GPT-2's, LLaMA-3's, Qwen2's)")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    by_id |= {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    if max(by_id) >= rows:
        raise ConfigError(f"{tokenizer}: token id {max(by_id)} has no row in the model's "
                          f"embedding ({rows} rows)")
    names, types = [], []
    for i in range(rows):
        names.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.CONTROL
                     if i in special else gguf.TokenType.NORMAL)
    return names, types


def save_gguf(config, cls_name: str, state: dict, tokenizer: Path | None, path: Path) -> None:
    """``state`` (the plain model's weights, by transformers' names) of a ``cls_name`` model
    with ``config`` as a GGUF file at ``path``, with ``tokenizer`` (a save_pretrained
    tokenizer directory) if given."""
    import gguf

    arch = ARCHITECTURES.get(cls_name)
    if arch is None:
        raise ConfigError(f"a {cls_name} model: the GGUF export writes {sorted(ARCHITECTURES)}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type {rope['rope_type']!r}: the GGUF export writes the "
                          "default rotary embedding")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        names, types = tokens(tokenizer, config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(names)
        writer.add_token_types(types)
        gguf.SpecialVocab(tokenizer, load_merges=True, n_vocab=len(names)).add_to_gguf(
            writer, quiet=True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    state = dict(state)
    if "lm_head.weight" not in state:  # tied: the head is the embedding
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq"):  # computed from the config, not a weight
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConfigError(f"{name}: no GGUF name for it (a {cls_name} holds no such "
                              "tensor as llama.cpp reads the architecture)")
        value = tensor.detach().float().numpy()
        if arch == "llama" and ".attn_q." in mapped:
            value = permuted(value, heads)
        elif arch == "llama" and ".attn_k." in mapped:
            value = permuted(value, kv_heads)
        writer.add_tensor(mapped, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
