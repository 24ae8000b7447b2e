"""docs/coverage.md from the coverage records (check.py): per task, how many architectures
reach each phase; the failures grouped by cause, the largest group first, so the next rule or
converter to write is the first line; then every architecture's row."""
from __future__ import annotations

import re
from collections import defaultdict

from pipelines.coverage.check import BATCH, IMAGE, PHASES, SEQUENCE, SMALL, summary

# what differs between records that fail the same way: the layer, a binding, a number, a
# quoted name (an op name such as relax.nn.conv1d is kept)
_VARYING = re.compile(r"in layer .*?\(bound to \w+\)|0x[0-9a-f]+|(?<![\w.])\d+(\.\d+)?(e-?\d+)?"
                      r"|'[^']*'|\"[^\"]*\"")


def cause(record: dict) -> str:
    """The phase and the error with its numbers and quoted names blanked: records that fail
    the same way group together."""
    return f"{record['phase']}: {_VARYING.sub('…', record.get('error', ''))[:160]}"


def render(records: list[dict], expected: int) -> str:
    """The page for ``records``, of the ``expected`` architectures of the mappings (fewer
    while a run is under way or was cut short: the page says so)."""
    lines = ["# Model coverage: the transformers zoo through the chain",
             "",
             "Written by the coverage stage (`dvc repro coverage/dvc.yaml`; "
             "pipelines/coverage/check.py): each architecture of transformers' causal-LM, "
             "sequence- and image-classification auto mappings, shrunk "
             f"({SMALL['num_hidden_layers']} layers, small widths, seeded; a batch of {BATCH} "
             f"sequences of {SEQUENCE} tokens or {BATCH} images of {IMAGE} x {IMAGE}), one "
             "full-BP SGD step compiled and compared with PyTorch's step with the class's "
             "own loss. `ok`: the loss and every tensor within 1e-4 of its scale, the "
             "trained set PyTorch's; `noise`: a tensor further off, but no further than "
             "PyTorch's own step moves when its weights move by 8 float32 ulps, and a loss "
             "no further from PyTorch's float64 loss than PyTorch's float32 loss "
             "(docs/frontends.md). Otherwise the first phase it does not pass.",
             "",
             f"Checked: {len(records)} of the {expected} architectures"
             + ("." if len(records) >= expected else
                " (a run cut short: `dvc repro coverage/dvc.yaml` resumes it)."),
             "",
             "`share ok`: of all; `of PyTorch's`: of those whose shrunk model PyTorch builds "
             "and steps (the phases after `pytorch`: what the chain is given).",
             "",
             "| task | architectures | " + " | ".join(PHASES) + " | share ok | of PyTorch's |",
             "|---|---:|" + "---:|" * len(PHASES) + "---:|---:|"]
    for task, counts in summary(records).items():
        lines.append(f"| {task} | {counts['architectures']} | "
                     + " | ".join(str(counts[p]) for p in PHASES)
                     + f" | {counts['match_share']:.0%} | "
                     f"{counts['match_share_of_pytorch_steps']:.0%} |")
    groups = defaultdict(list)
    for record in records:
        if record["phase"] != "ok":
            groups[cause(record)].append(record["architecture"])
    lines += ["", "## Failures by cause", "", "| architectures | cause | examples |",
              "|---:|---|---|"]
    for text, names in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        shown = ", ".join(sorted(names)[:4]) + (" …" if len(names) > 4 else "")
        lines.append(f"| {len(names)} | {text.replace('|', '/')} | {shown} |")
    lines += ["", "## Every architecture", "",
              "| task | model type | architecture | phase | error |", "|---|---|---|---|---|"]
    for record in sorted(records, key=lambda r: (r["task"], r["architecture"], r["model_type"])):
        error = record.get("error", "").replace("|", "/")[:200]
        lines.append(f"| {record['task']} | {record['model_type']} | {record['architecture']} | "
                     f"{record['phase']} | {error} |")
    return "\n".join(lines) + "\n"
