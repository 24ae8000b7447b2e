"""Small PyTorch classifiers, each built around layers and tensor operations that common
models use and ``torch.export`` turns into operators of their own (issue 44's list): a user's
model file, ``entry(batch_size)`` -> (module, example inputs). Each ends in a 4-class head, so
the classification loss trains it."""
import torch
from torch import nn

CLASSES = 4


class Conv1dMixer(nn.Module):
    """A 1-D conv stem over [batch, channels, length], an MLP-mixer block (token mixing by
    a transposed linear) and Fourier mixing (FNet's real part of a 2-D FFT; an inverse FFT
    scaled as the other conventions do), squeezed to the head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.mix_tokens = nn.Linear(12, 12)
        self.mix_channels = nn.Linear(8, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = torch.relu(self.norm(self.stem(x)))
        h = h + self.mix_tokens(h)
        h = h.transpose(1, 2) + self.mix_channels(h.transpose(1, 2))
        h = h + torch.fft.fftn(h, dim=(1, 2)).real
        h = torch.fft.ifft(h, norm="ortho").real + torch.fft.fft(h, dim=1, norm="forward").real
        pooled = h.mean(1, keepdim=True).squeeze(1)
        return self.head(pooled)


def conv1d_mixer(batch_size: int):
    return Conv1dMixer(), {"x": torch.randn(batch_size, 3, 12)}


class Conv3dNet(nn.Module):
    """A 3-D conv and 3-D pooling (video clips)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 6, 3, padding=1)
        self.pool = nn.MaxPool3d(2)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        h = self.pool(torch.relu(self.conv(x)))
        return self.head(h.mean((2, 3, 4)))


def conv3d_net(batch_size: int):
    return Conv3dNet(), {"x": torch.randn(batch_size, 2, 4, 6, 6)}


class TransposedConvs(nn.Module):
    """Upsampling decoders: a transposed 1-D and 2-D conv, nearest and bilinear interpolation."""

    def __init__(self):
        super().__init__()
        self.up1 = nn.ConvTranspose1d(3, 4, 4, stride=2, padding=1)
        self.up2 = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, sequence, image):
        a = torch.relu(self.up1(sequence))
        b = torch.relu(self.up2(image))
        c = nn.functional.interpolate(b, scale_factor=2, mode="nearest")
        d = nn.functional.interpolate(b, size=(5, 7), mode="bilinear", align_corners=False)
        return self.head(torch.cat([a.mean(2), b.mean((2, 3)), c.amax((2, 3)),
                                    d.mean((2, 3))], 1))


def transposed_convs(batch_size: int):
    return TransposedConvs(), {"sequence": torch.randn(batch_size, 3, 5),
                               "image": torch.randn(batch_size, 3, 4, 4)}


class Pools(nn.Module):
    """Pooling variants: average with padding, max with a stride, adaptive average and max,
    average over a window wider than the input with ceil mode (EfficientNet's pooler: the
    window is cut to the input)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.head = nn.Linear(6 * 5, CLASSES)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        a = nn.functional.avg_pool2d(h, 3, stride=2, padding=1).mean((2, 3))
        b = nn.functional.max_pool2d(h, 2, stride=2).amax((2, 3))
        c = nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        d = nn.functional.adaptive_max_pool2d(h, (2, 2)).mean((2, 3))
        e = nn.functional.avg_pool2d(h, 12, ceil_mode=True).flatten(1)
        return self.head(torch.cat([a, b, c, d, e], 1))


def pools(batch_size: int):
    return Pools(), {"x": torch.randn(batch_size, 3, 10, 10)}


class LayerScale(nn.Module):
    """A PoolFormer block: a residual branch scaled per channel by a small learned vector,
    reshaped to [channels, 1, 1], which the backward pass reads again after the vector's
    own update could have been written (the update in place waits for every reader); its
    features divided by a statistic taken under ``torch.no_grad()`` (the shift read there alone
    gets no gradient) and rounded straight through (``detach``); a no_grad block whose result
    nothing reads (Phi-4 multimodal's check for image tokens), which a saved program lost; a
    layer read for its shape alone (``zeros_like``: MRA's attention without its kernels),
    which gets no gradient."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(1, 8)
        self.mix = nn.Conv2d(8, 8, 1)
        self.scale = nn.Parameter(torch.full((8,), 1e-2))
        self.shift = nn.Parameter(torch.ones(8, 1, 1))
        self.shaped = nn.Conv2d(3, 8, 1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.conv(x)
        pooled = nn.functional.avg_pool2d(self.norm(h), 3, 1, 1, count_include_pad=False)
        h = h + self.scale[:, None, None] * self.mix(pooled)
        with torch.no_grad():
            spread = (h + self.shift).std()
        with torch.no_grad():
            (x == 0).logical_not()
        h = h / (1 + spread) + 0.1 * (h.round() - h).detach() + torch.zeros_like(self.shaped(x))
        return self.head(h.mean((2, 3)))


def layer_scale(batch_size: int):
    return LayerScale(), {"x": torch.randn(batch_size, 3, 8, 8)}


class GatherScatter(nn.Module):
    """Integer-indexed reads and writes: an embedding bag, gather along an axis and a
    scatter-add of rows at indices divided with rounding, rows read by negative indices (from
    the end, as Falcon reads its key and value heads, and XLNet its last token) scaled by the
    log and quotient of integers, elements picked by two index lists, rows reversed by a
    range counting down, a cumulative sum, an einsum, a masked fill with a mask made from the
    input, and each row's last masked position read through a boolean mask
    (``x[mask].view(b, -1, d)[:, -1]``, as BART's classifier reads its end-of-sentence
    tokens); segment means and minima
    (``scatter_reduce`` without the target's values: TAPAS's cells); integers clamped on
    one side (T5Gemma's position buckets)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 6, mode="mean")  # ids below 100, as the tests draw them
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, ids, x):
        bag = self.bag(ids)                                        # [b, 6]
        h = self.proj(x)                                           # [b, 5, 6]
        # integer division rounded toward zero and down, of negative numbers too (JetMoE
        # finds a token's row by its expert slot, rounded toward zero)
        centred = (ids[:, :5, None] - 50).clamp(max=40).clamp_min(-45)  # integers, one bound
        toward_zero = centred.div(7, rounding_mode="trunc").remainder(5)
        down = centred.div(7, rounding_mode="floor").remainder(5)
        picked = torch.gather(h, 1, toward_zero.expand(-1, -1, 6))
        summed = torch.zeros_like(h).scatter_add(1, down.expand(-1, -1, 6), h)
        running = torch.cumsum(h, 1)
        attention = torch.einsum("bid,bjd->bij", h, h).masked_fill(x[:, :, :1] > 0, -1e4)
        mixed = torch.einsum("bij,bjd->bid", attention.softmax(-1), h)
        # PyTorch computes log and true division of integers in floating point
        scale = torch.log(ids[:, :1] + 2) + ids[:, 1:2] / 7       # [b, 1]
        last = (h[:, [-1, -2]].mean(1) + h[:, -2]) * scale        # [b, 6]
        zipped = h[:, [0, 2, 4], [1, 3, 5]].mean(1, keepdim=True)  # [b, 1]: 3 elements
        # rows in reverse, by a range counting down past zero (Funnel's relative positions)
        reverse = h[:, torch.arange(4, -1, -1)] * torch.arange(2, -3, -1)[None, :, None]
        ends = (ids[:, :5] < 200).logical_and(torch.arange(5) % 2 == 0)  # rows 0, 2, 4
        final = h[ends].view(h.shape[0], -1, 6)[:, -1]            # [b, 6]: row 4
        segments = down.expand(-1, -1, 6)                          # 5 rows into 5 segments
        means = torch.ones_like(h).scatter_reduce(1, segments, h, "mean", include_self=False)
        firsts = torch.full((h.shape[0], 5), 9.0).scatter_reduce(
            1, down[..., 0], torch.arange(5.0).expand(h.shape[0], -1), "amin",
            include_self=False)                                    # a segment's first row
        return self.head(bag + last + zipped + final
                         + (picked + summed + running + mixed + reverse + 0.1 * means).mean(1)
                         + 0.1 * firsts.mean(1, keepdim=True))


def gather_scatter(batch_size: int):
    return GatherScatter(), {"ids": torch.randint(0, 100, (batch_size, 7)),
                             "x": torch.randn(batch_size, 5, 6)}


class StridedRotary(nn.Module):
    """Interleaved rotary embeddings: GPT-J's and CodeGen's (the even and odd channels, read
    with a stride of 2, rotated and written back interleaved) and DeepSeek's (the rotary tail
    of each head, split off, its even and odd channels rotated and concatenated), and LLaMA
    4's and DeepSeek V2's (channel pairs as complex numbers, times a rotation from
    ``torch.polar``), under a causal mask filled with -inf."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.heads = nn.Linear(8, 48)                              # 4 heads of 8 + 4
        self.head = nn.Linear(8, CLASSES)
        self.tail_head = nn.Linear(48, CLASSES)

    def forward(self, x):
        h = self.proj(x)                                           # [b, 6, 8]
        angle = torch.arange(6, dtype=torch.float32)[:, None] * torch.arange(1, 5) / 4
        even, odd = h[..., ::2], h[..., 1::2]
        rotated = torch.stack([even * angle.cos() - odd * angle.sin(),
                               even * angle.sin() + odd * angle.cos()], -1).flatten(-2)
        kept, tail = self.heads(x).view(*x.shape[:2], 4, 12).split([8, 4], -1)
        cos, sin = angle[:, None, :2].cos(), angle[:, None, :2].sin()  # [6, 1, 2]
        even, odd = tail[..., 0::2], tail[..., 1::2]
        tail = torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1)
        deepseek = torch.cat([kept, tail], -1).flatten(-2)         # [b, 6, 48]
        turn = torch.polar(torch.ones_like(angle), angle) * 0.5   # [6, 4] complex
        pairs = torch.view_as_complex(h.reshape(*h.shape[:-1], 4, 2))
        llama4 = torch.view_as_real(pairs * turn.unsqueeze(0)).flatten(-2)  # [b, 6, 8]
        scores = llama4 @ h.transpose(1, 2)
        later = torch.ones(6, 6, dtype=torch.bool).triu(1)
        scores = torch.where(later, torch.full_like(scores, float("-inf")), scores)
        attended = scores.softmax(-1) @ h
        return self.head(rotated[:, ::2].mean(1) + attended.mean(1)) + \
            self.tail_head(deepseek.mean(1))


def strided_rotary(batch_size: int):
    return StridedRotary(), {"x": torch.randn(batch_size, 6, 8)}


class TopKRouter(nn.Module):
    """A mixture-of-experts block with top-2 routing: router logits, top-k, softmax over the
    chosen, each expert's output weighted by its routing weight (dense over experts, as small
    MoE models compute it)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(6, 4)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        weights, chosen = self.router(x).topk(2, -1)
        weights = weights.softmax(-1)
        routing = torch.zeros(x.shape[:-1] + (4,)).scatter(-1, chosen, weights)
        out = sum(routing[..., e, None] * expert(x) for e, expert in enumerate(self.experts))
        return self.head(out.mean(1))


def top_k_router(batch_size: int):
    return TopKRouter(), {"x": torch.randn(batch_size, 5, 6)}


class IndexedRouter(nn.Module):
    """Experts picked by an indexer whose scores are read only through top-k's indices, so no
    gradient reaches it (DeepSeek's lightning indexer; PyTorch trains it not), top-k unsorted,
    a fixed position table (requires_grad=False, as a sinusoidal one), and a split with an
    empty section (a shrunk config's zero-width rotary part)."""

    def __init__(self):
        super().__init__()
        self.indexer = nn.Linear(6, 4)
        self.gate = nn.Linear(6, 4)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.positions = nn.Parameter(torch.randn(5, 6), requires_grad=False)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        x = x + self.positions
        chosen = self.indexer(x).topk(2, -1, sorted=False).indices
        weights = self.gate(x).gather(-1, chosen).softmax(-1)
        routing = torch.zeros(x.shape[:-1] + (4,)).scatter(-1, chosen, weights)
        out = sum(routing[..., e, None] * expert(x) for e, expert in enumerate(self.experts))
        empty, rest = out.split([0, 6], -1)
        return self.head(torch.cat([rest, empty], -1).mean(1))


def indexed_router(batch_size: int):
    return IndexedRouter(), {"x": torch.randn(batch_size, 5, 6)}


class MaskedAdapters(nn.Module):
    """Rows mapped by the adapter their mask picks and written back in place
    (``out[mask] = f(x[mask])``: X-MOD's language adapters, a language per sequence, none
    picked by some batches), then added to over tokens (``out[mask] += g(x[mask])``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 4), nn.GELU(), nn.Linear(4, 6))
            for _ in range(2))
        self.token = nn.Linear(6, 6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, ids, x):
        h = self.proj(x)                                           # [b, 5, 6]
        language = ids[:, 0] % 2
        out = torch.zeros_like(h)
        for index, adapter in enumerate(self.adapters):
            picked = language == index
            out[picked] = adapter(h[picked])
        marked = ids[:, 1:6] > 50                                  # [b, 5]: tokens
        out[marked] += torch.tanh(self.token(h[marked])) * 0.5
        return self.head((out + h).mean(1))


def masked_adapters(batch_size: int):
    return MaskedAdapters(), {"ids": torch.randint(0, 100, (batch_size, 7)),
                              "x": torch.randn(batch_size, 5, 6)}


class Patches(nn.Module):
    """Overlapping patches cut (``F.unfold``), mixed and summed back (``F.fold``: an
    index_put that adds along whole batch and channel axes), as MobileViT-v2 does; and
    sliding windows (``Tensor.unfold``), reversed, as Inkling 2's causal conv reads them
    after its (empty) cache."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mix = nn.Linear(36, 36)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        patches = nn.functional.unfold(torch.relu(self.conv(x)), 3, padding=1, stride=2)
        h = nn.functional.fold(self.mix(patches.transpose(1, 2)).transpose(1, 2), (5, 5), 3,
                               padding=1, stride=2)
        context = torch.cat([h.flatten(2)[..., :0], h.flatten(2)], -1)  # an empty cache
        windows = context.unfold(-1, 3, 2).flip(-1)                # [b, 4, 12, 3]
        return self.head(h.mean((2, 3)) + (windows * torch.arange(1.0, 4.0)).mean((2, 3)))


def patches(batch_size: int):
    return Patches(), {"x": torch.randn(batch_size, 3, 5, 5)}
