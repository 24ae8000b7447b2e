"""The tokenizer the user's text is read with: the model directory's own (``tokenizer.json``
through the ``tokenizers`` library, its special tokens and chat template from
``tokenizer_config.json``), or where it has none, a byte-level BPE trained here on the training
split (deterministic for the same files). The data stage saves it as ``save_pretrained`` does
(tokenizer/ beside the arrays), and the fine-tuned model is saved with it.

A chat is rendered with the model's chat template, or where it has none, ``CHATML`` (the
template Qwen2 uses; a trained tokenizer has its markers as special tokens), through
transformers' ``apply_chat_template``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.schema import ConfigError

FILE = "tokenizer.json"
DIRECTORY = "tokenizer"  # the data stage's save_pretrained copy, beside the arrays
END = "<|endoftext|>"  # a trained tokenizer's end of text, and its padding
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = [END, "<|im_start|>", "<|im_end|>"]  # a trained tokenizer's special tokens
MIN_VOCABULARY = 256 + len(SPECIALS)  # a byte-level BPE's alphabet and its specials


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer``, the ids that end a text and pad a row, and what
    ``tokenizer_config.json`` says (special tokens, chat template)."""

    inner: object
    end: int | None  # appended after each text (None: the model's has none)
    pad: int
    config: dict = field(default_factory=dict)  # tokenizer_config.json's keys

    def encode(self, text: str, special: bool = True) -> tuple[list[int], list[tuple]]:
        """The ids of ``text`` and each one's character span in it (special tokens the
        tokenizer adds, such as a BOS: (0, 0))."""
        encoding = self.inner.encode(text, add_special_tokens=special)
        return encoding.ids, encoding.offsets

    def wrapped(self):
        """The transformers tokenizer of this one (what ``AutoTokenizer`` loads back)."""
        from transformers import PreTrainedTokenizerFast

        keys = {k: v for k, v in self.config.items()
                if k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template")}
        keys.setdefault("chat_template", CHATML)
        return PreTrainedTokenizerFast(tokenizer_object=self.inner, **keys)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """A chat as the model's template (or CHATML) writes it."""
        return self.wrapped().apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def save(self, directory: Path) -> None:
        """As save_pretrained writes it (tokenizer.json, tokenizer_config.json)."""
        self.wrapped().save_pretrained(str(directory))


def model_tokenizer(directory: Path | None) -> Tokenizer | None:
    """The tokenizer in ``directory`` (tokenizer.json, and tokenizer_config.json's end and
    padding tokens and chat template, or chat_template.jinja), or None where it has none."""
    from tokenizers import Tokenizer as Inner

    if directory is None or not (directory / FILE).is_file():
        return None
    inner = Inner.from_file(str(directory / FILE))
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    template = directory / "chat_template.jinja"  # where transformers 5 saves it
    if template.is_file():
        config["chat_template"] = template.read_text()
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):  # AddedToken dicts
        if isinstance(config.get(key), dict):
            config[key] = config[key].get("content")

    def token(key: str) -> int | None:
        return inner.token_to_id(config[key]) if config.get(key) else None

    end, pad = token("eos_token"), token("pad_token")
    return Tokenizer(inner, end, pad if pad is not None else (end if end is not None else 0),
                     config)


def trained_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (its first, SPECIALS) trained on ``texts``:
    the same for the same texts."""
    from tokenizers import Tokenizer as Inner
    from tokenizers import decoders, models, pre_tokenizers, trainers

    inner = Inner(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    inner.train_from_iterator(texts, trainer)
    end = inner.token_to_id(END)
    return Tokenizer(inner, end, end, {"eos_token": END, "pad_token": END,
                                       "chat_template": CHATML})


def tokenizer_for(source, texts, vocab_size: int | None, key: str) -> Tokenizer:
    """The model's own tokenizer (``source.directory``), or one trained on ``texts`` (an
    iterable of strings) with ``vocab_size`` tokens, at most the model's vocabulary
    (``source.vocabulary``: its embedding has no row for more)."""
    own = model_tokenizer(source.directory)
    if own is not None:
        return own
    limit = source.vocabulary
    size = vocab_size or limit
    if size is None:
        raise ConfigError(f"{key}.vocab_size: the model has no tokenizer.json and its "
                          "vocabulary size is not known here; set it (at most the model's "
                          "vocabulary)")
    if not MIN_VOCABULARY <= size <= (limit or size):
        raise ConfigError(f"{key}.vocab_size={size}: a trained byte-level BPE takes "
                          f"{MIN_VOCABULARY} to {limit or 'the model vocabulary'} tokens (the "
                          "model's embedding has no row for more)")
    return trained_tokenizer(list(texts), size)
