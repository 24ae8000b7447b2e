"""Tiny Hugging Face transformers models built from configs (random init, seeded by the caller;
nothing downloaded), as a user's model file gives them to the torch frontend:
``entry(batch_size)`` returns (module, example inputs by forward's names).

transformers' models return a ModelOutput and keep a key-value cache; a training step wants the
logits alone and no cache, so each model is wrapped (``TextLogits`` and its kin). Dropout is off
in every config: the compiled step and PyTorch's must see the same graph.
"""
import torch
import transformers

SEQ, VOCAB, LABELS, IMAGE = 16, 128, 4, 32


class TextLogits(torch.nn.Module):
    """A transformers model's logits from token ids, without its cache. The wrapped model's
    parameter names gain a ``model.`` prefix: model.model.layers.0.self_attn.q_proj.weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class MaskedTextLogits(TextLogits):
    """An encoder's logits from token ids, attention mask and token types (BERT's inputs)."""

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).logits


class ImageLogits(TextLogits):
    """A vision model's logits from pixel values."""

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def tokens(batch_size: int) -> dict[str, torch.Tensor]:
    # no pad token (id 0) in the example: a decoder classifier reads each row's last token
    return {"input_ids": torch.randint(1, VOCAB, (batch_size, SEQ))}


DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0, num_labels=LABELS)


def llama_classifier(batch_size: int):
    """LLaMA with grouped-query attention (4 query heads, 2 key-value heads)."""
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**DECODER))
    return TextLogits(model), tokens(batch_size)


def qwen2_classifier(batch_size: int):
    """Qwen2 (grouped-query attention, biases on q/k/v)."""
    model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**DECODER))
    return TextLogits(model), tokens(batch_size)


def gpt2_classifier(batch_size: int):
    """GPT-2: learned positions, fused qkv (Conv1D), input and output embeddings tied."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, pad_token_id=0, num_labels=LABELS,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return TextLogits(transformers.GPT2ForSequenceClassification(config)), tokens(batch_size)


def bert_classifier(batch_size: int):
    """BERT with an attention mask (the last rows padded) and token types."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, num_labels=LABELS,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = tokens(batch_size)
    mask = torch.ones(batch_size, SEQ, dtype=torch.int64)
    mask[:, SEQ // 2:] = 0
    types = torch.zeros(batch_size, SEQ, dtype=torch.int64)
    types[:, SEQ // 4:] = 1
    return (MaskedTextLogits(transformers.BertForSequenceClassification(config)),
            {**inputs, "attention_mask": mask, "token_type_ids": types})


def vit_classifier(batch_size: int):
    """ViT: 8x8 patches of a 32x32 image, a class token."""
    config = transformers.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=32,
                                    intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_labels=LABELS,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return (ImageLogits(transformers.ViTForImageClassification(config)),
            {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)})


def resnet_classifier(batch_size: int):
    """ResNet: bottleneck blocks with batch norm (training mode: batch statistics)."""
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       layer_type="bottleneck", num_labels=LABELS)
    return (ImageLogits(transformers.ResNetForImageClassification(config)),
            {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE)})


# Language-model heads: [batch, seq, vocab] logits (Model.task causal_lm / masked_lm), and a
# one-value regression head (task regression).
LM = {k: v for k, v in DECODER.items() if k != "num_labels"}


def llama_causal_lm(batch_size: int):
    """LLaMA with grouped-query attention and its language-model head."""
    return TextLogits(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LM))), \
        tokens(batch_size)


def gpt2_causal_lm(batch_size: int):
    """GPT-2's language-model head, tied to its input embeddings (one parameter, two uses)."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return TextLogits(transformers.GPT2LMHeadModel(config)), tokens(batch_size)


def _bert(cls, batch_size: int, **config):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **config)
    _, inputs = bert_classifier(batch_size)
    return MaskedTextLogits(cls(config)), inputs


def bert_masked_lm(batch_size: int):
    """BERT's masked-LM head (its decoder tied to the word embeddings), with mask and types."""
    return _bert(transformers.BertForMaskedLM, batch_size)


def bert_regressor(batch_size: int):
    """BERT with a one-value head: a score per sequence (task regression)."""
    return _bert(transformers.BertForSequenceClassification, batch_size, num_labels=1)
