"""The user's JSON Lines records for a causal language model, one record a row of ``seq_len``
tokens (cut where longer, padded where shorter: padding is masked and scores nothing). A record
is one of

    {"text": "..."}                                   every token learned
    {"prompt": "...", "completion": "..."}            the completion learned
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
                                                      the assistant's turns learned

A chat is rendered with the model's chat template (tokenizer_config.json) or, where it has none,
ChatML (data/tokenizer.py). With ``mask_prompt`` (the default) the prompt's, the system's and
the user's tokens get the label -100, so only the answer is learned, as transformers' and TRL's
trainers do; an assistant turn's span is what the template adds after the conversation so far
with the generation prompt (its end marker included: the model learns to stop). The held-out
records are a seeded share of all of them.

    models.<name>.data: {kind: jsonl, files: data/chat.jsonl, seq_len: 256}
"""
from __future__ import annotations

import json
from typing import Literal

import numpy as np
from pydantic import Field, PositiveInt

from pipelines.data.files import held_out, read_text, relative, user_files
from pipelines.schema import ConfigError, Strict
from pipelines.tasks import IGNORE_INDEX

KEY = "models.<name>.data"
FORMATS = (("text",), ("prompt", "completion"), ("messages",))
ROLES = ("system", "user", "assistant", "tool")

TASKS = ("causal_lm",)  # the tasks its labels are for (fine-tuning checks it)


class Config(Strict):
    """models.<name>.data with kind jsonl."""

    kind: Literal["jsonl"]
    files: str  # a .jsonl file, or a folder or glob of them, under data/
    seq_len: PositiveInt
    mask_prompt: bool = True  # false: every token of a record is learned
    held_out: float = Field(0.1, gt=0, lt=1)  # the share of records scored, not trained on
    vocab_size: PositiveInt | None = None  # a trained tokenizer's (the model has none)


def records(files) -> list[tuple[dict, str]]:
    """Each line's record and where it is (file:line), checked against FORMATS."""
    found = []
    for path in files:
        for number, line in enumerate(read_text(path, f"{KEY}.files").splitlines(), 1):
            where = f"{relative(path)}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: not JSON ({err.msg}); each line of a .jsonl file "
                                  "is one JSON object") from err
            if not isinstance(record, dict) or not any(set(f) <= set(record) for f in FORMATS):
                raise ConfigError(f"{where}: a record needs the keys "
                                  f"{' or '.join(str(list(f)) for f in FORMATS)}")
            used = (("messages",) if "messages" in record else ("text",) if "text" in record
                    else ("prompt", "completion"))  # what rendered reads
            wrong = [k for k in used if not isinstance(record[k], list if k == "messages"
                                                        else str)]
            if wrong:
                raise ConfigError(f"{where}: {wrong[0]!r} is "
                                  f"{type(record[wrong[0]]).__name__} {record[wrong[0]]!r:.40}; "
                                  "allowed: " + ("a list of messages" if used == ("messages",)
                                                 else "text (a JSON string)"))
            for message in record.get("messages", []):
                if (not isinstance(message, dict) or message.get("role") not in ROLES
                        or not isinstance(message.get("content"), str)):
                    raise ConfigError(f"{where}: a message is {{'role': one of {list(ROLES)}, "
                                      f"'content': text}}; this one is {message!r}")
            found.append((record, where))
    return found


def rendered(record: dict, tokenizer) -> tuple[str, list[tuple[int, int]], bool]:
    """(the record's text, the character spans learned with mask_prompt, whether the text
    has the model's special tokens written out: a chat template's)."""
    if "messages" in record:
        messages = record["messages"]
        text = tokenizer.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(tokenizer.render(messages[:i], add_generation_prompt=True))
            end = len(tokenizer.render(messages[: i + 1]))
            if not text.startswith(tokenizer.render(messages[: i + 1])):
                raise ConfigError("the chat template does not render a conversation's start "
                                  "as its own prefix, so its turns cannot be told apart; set "
                                  f"{KEY}.mask_prompt=false to learn every token")
            spans.append((start, end))
        return text, spans, True
    if "text" in record:
        return record["text"], [(0, len(record["text"]))], False
    return (record["prompt"] + record["completion"],
            [(len(record["prompt"]), len(record["prompt"]) + len(record["completion"]))], False)


def row(record: dict, tokenizer, cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, labels, attention mask) of one record, each ``seq_len`` long."""
    text, spans, templated = rendered(record, tokenizer)
    # a template writes its own BOS; plain text gets the tokenizer's, and the end of text
    ids, offsets = tokenizer.encode(text, special=not templated)
    # a token is learned where it holds any of an answer's characters (one that starts in the
    # prompt, " yes" after "assistant:", is the answer's first)
    learned = [any(start < b and end > a for a, b in spans) if cfg.mask_prompt else True
               for start, end in offsets]
    if not templated and tokenizer.end is not None:
        ids, learned = ids + [tokenizer.end], learned + [True]
    ids, learned = ids[: cfg.seq_len], learned[: cfg.seq_len]
    pad = cfg.seq_len - len(ids)
    x = np.array(ids + [tokenizer.pad] * pad, dtype=np.int64)
    y = np.where(np.array(learned + [False] * pad), x, IGNORE_INDEX)
    return x, y, np.array([1] * len(ids) + [0] * pad, dtype=np.int64)


def make(cfg: Config, seed: int, source):
    from pipelines.data import Dataset
    from pipelines.data.tokenizer import tokenizer_for

    files = user_files(cfg.files, f"{KEY}.files", (".jsonl",))
    found = records(files)
    unanswered = [where for record, where in found if "messages" in record
                  and not any(m["role"] == "assistant" for m in record["messages"])]
    if unanswered and cfg.mask_prompt:
        raise ConfigError(f"{unanswered[0]}: a chat without an assistant turn learns nothing "
                          f"(mask_prompt: only the assistant's turns are learned; "
                          f"{len(unanswered)} such records); add the answer, or set "
                          f"{KEY}.mask_prompt=false to learn every token")
    train, test = held_out(len(found), cfg.held_out, seed, "records", f"{KEY}.files")

    def plain(record: dict) -> str:  # what a tokenizer is trained on
        if "messages" in record:
            return "\n".join(m["content"] for m in record["messages"])
        return record["text"] if "text" in record else record["prompt"] + record["completion"]

    tokenizer = tokenizer_for(source, (plain(found[i][0]) for i in train), cfg.vocab_size, KEY)
    arrays = {}
    for name, chosen in (("finetune_train", train), ("finetune_test", test)):
        rows = [row(found[i][0], tokenizer, cfg) for i in chosen]
        # a row scores from its second position on (the loss predicts the next token)
        kept = [r for r in rows if (r[1][1:] != IGNORE_INDEX).any()]
        if len(kept) < len(rows):
            print(f"{KEY}: {len(rows) - len(kept)} {name.removeprefix('finetune_')} records "
                  f"learn nothing within seq_len={cfg.seq_len}: left out", flush=True)
        if not kept:
            raise ConfigError(f"{KEY}: no {name.removeprefix('finetune_')} record keeps a "
                              f"learned token within seq_len={cfg.seq_len} (e.g. "
                              f"{found[chosen[0]][1]}); raise seq_len or shorten the prompts")
        x, y, mask = (np.stack(column) for column in zip(*kept))
        arrays |= {f"{name}_x": x, f"{name}_y": y, f"{name}_attention_mask": mask}
    return Dataset(arrays, tokenizer, files)
