"""A LLaMA-architecture decoder (RMSNorm, rotary embeddings, SwiGLU, causal attention): the
paper's LLM workload at a size this machine holds (conf/model/llama_tiny.yaml).

``llama_decoder(...)`` returns the module, from a seeded initialisation (the caller seeds
torch), and an example batch of token ids.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (LLaMA's norm: no centring, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the head dimension's two halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings, no biases."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, cos, sin, mask):
        batch, seq, dim = x.shape
        head_dim = dim // self.heads

        def split(t):  # (batch, seq, dim) -> (batch, heads, seq, head_dim)
            return t.view(batch, seq, self.heads, head_dim).transpose(1, 2)

        q = _rotate(split(self.q_proj(x)), cos, sin)
        k = _rotate(split(self.k_proj(x)), cos, sin)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + mask
        out = torch.softmax(scores, dim=-1) @ split(self.v_proj(x))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): gate and up are the FFN's first linears, down its second."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.input_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.post_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.mlp(self.post_norm(x))


class LlamaDecoder(nn.Module):
    """A LLaMA-architecture decoder (RMSNorm, rotary embeddings, SwiGLU, causal attention).

    ``forward(tokens (batch, seq))`` returns next-token logits flattened to
    (batch * seq, vocab), so token-level cross-entropy is the same loss the image models use."""

    def __init__(self, vocab: int = 2048, dim: int = 256, layers: int = 4, heads: int = 4,
                 hidden: int = 688, seq_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.arange(seq_len).float()[:, None] / 10000 ** (torch.arange(half) / half)
        # Position tables and the causal mask are constants of the graph, not state.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("mask", torch.full((seq_len, seq_len), float("-inf")).triu(1),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0, 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        logits = self.lm_head(self.norm(x))
        return logits.reshape(-1, logits.shape[-1])

    def blocks(self) -> list[str]:
        return [f"layers.{i}" for i in range(len(self.layers))]


def llama_decoder(batch_size: int, vocab: int = 2048, dim: int = 256, layers: int = 4,
                  heads: int = 4, hidden: int = 688, seq_len: int = 128):
    """The model and an example batch of token ids."""
    model = LlamaDecoder(vocab=vocab, dim=dim, layers=layers, heads=heads, hidden=hidden,
                         seq_len=seq_len)
    return model, {"tokens": torch.zeros(batch_size, seq_len, dtype=torch.int64)}
