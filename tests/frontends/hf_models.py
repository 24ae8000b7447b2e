"""A Hugging Face transformers model as a user's model file gives it to the torch frontend
(tests/test_hf_transformers.py exports it to ONNX): ``entry(batch_size)`` returns (module,
example inputs by forward's names). The transformers frontend takes the same model from its
config directory, tests/frontends/hf/bert, without a file.

transformers' models return a ModelOutput; a training step wants the logits alone, so the model
is wrapped. Dropout is off in the config: the compiled step and PyTorch's must see the same
graph.
"""
import torch
import transformers

SEQ, VOCAB, LABELS = 16, 128, 4


class MaskedTextLogits(torch.nn.Module):
    """An encoder's logits from token ids, attention mask and token types (BERT's inputs). The
    wrapped model's parameter names gain a ``model.`` prefix."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).logits


def bert_classifier(batch_size: int):
    """BERT with an attention mask (the last rows padded) and token types."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, num_labels=LABELS,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    mask = torch.ones(batch_size, SEQ, dtype=torch.int64)
    mask[:, SEQ // 2:] = 0
    types = torch.zeros(batch_size, SEQ, dtype=torch.int64)
    types[:, SEQ // 4:] = 1
    return (MaskedTextLogits(transformers.BertForSequenceClassification(config)),
            {"input_ids": torch.randint(1, VOCAB, (batch_size, SEQ)), "attention_mask": mask,
             "token_type_ids": types})
