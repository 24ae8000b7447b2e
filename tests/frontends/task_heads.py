"""Tiny PyTorch models, one per task's output shape (pipelines/training/loss.py), as a user's
model file gives them: ``entry(batch_size)`` -> (module, example inputs by forward's names)."""
import torch

SEQ, VOCAB, FEATURES = 6, 100, 5  # random_batch draws token ids below 100


class TokenLogits(torch.nn.Module):
    """[batch, seq] token ids -> [batch, seq, vocab] logits: a language model's head's shape."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8, padding_idx=0)  # PyTorch never updates row 0
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def token_logits(batch_size: int):
    return TokenLogits(), {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ))}


class Regressor(torch.nn.Module):
    """[batch, features] -> [batch, 2] values, times a learned 0-d scale held by the root
    module itself (its state-dict name is ``scale``, its shape ())."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2))
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, input):
        return self.net(input) * self.scale


def regressor(batch_size: int):
    return Regressor(), {"input": torch.randn(batch_size, FEATURES)}


class Classifier(torch.nn.Module):
    """[batch, features] -> [batch, 3] class logits: a small classifier to fine-tune."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 3))

    def forward(self, input):
        return self.net(input)


def classifier(batch_size: int):
    return Classifier(), {"input": torch.randn(batch_size, FEATURES)}
