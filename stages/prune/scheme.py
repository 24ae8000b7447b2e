"""Sparse-update schemes: which parameters a fine-tuning run updates.

A scheme (conf/sparse/<name>.yaml) is a list of rules; a parameter is updated when any rule
selects it. A rule selects by
  modules: glob patterns on the PyTorch module path ("features.*.conv.0.0", "classifier.*")
  kinds:   layer kinds (conv, conv_pointwise, conv_depthwise, linear, norm); optional
  blocks:  {first: k} or {last: k} of the model's repeated blocks; optional
  update:  weight, bias or both (a norm layer's shift counts as its bias)
Reserved for channel-level sparsity: ``channels`` and ``axis`` (not yet supported).
"""
from __future__ import annotations

import fnmatch

from pipelines.config import ConfigError

KINDS = {"conv", "conv_pointwise", "conv_depthwise", "linear", "norm"}
UPDATES = {"weight": {"weight"}, "bias": {"bias"}, "both": {"weight", "bias"}}
RULE_KEYS = {"name", "modules", "kinds", "blocks", "update"}
SOURCE = "params.yaml (sparse, from conf/sparse)"


def _rule_error(rule_name: str, message: str) -> ConfigError:
    return ConfigError(f"{SOURCE}: rule {rule_name!r}: {message}")


def _block_range(blocks: dict, count: int, rule_name: str) -> range:
    if not isinstance(blocks, dict) or len(blocks) != 1 or next(iter(blocks)) not in ("first",
                                                                                      "last"):
        raise _rule_error(rule_name, f"blocks={blocks!r}; allowed: {{first: k}} or {{last: k}}")
    (where, k), = blocks.items()
    if not isinstance(k, int) or not 1 <= k <= count:
        raise _rule_error(rule_name, f"blocks.{where}={k!r}; allowed: 1..{count} "
                                     f"(the model has {count} blocks)")
    return range(0, k) if where == "first" else range(count - k, count)


def select(scheme: dict, layers: dict) -> list[str]:
    """PyTorch names of the parameters ``scheme`` updates, in model order.

    ``layers`` is the import stage's layers.json. Every rule must select something."""
    rules = scheme.get("rules")
    if not rules:
        raise ConfigError(f"{SOURCE}: scheme {scheme.get('name')!r} has no rules")
    chosen: set[str] = set()
    for index, rule in enumerate(rules):
        name = rule.get("name", f"#{index}")
        unknown = set(rule) - RULE_KEYS
        if unknown:
            raise _rule_error(name, f"unknown keys {sorted(unknown)}; allowed: "
                                    f"{sorted(RULE_KEYS)}")
        update = rule.get("update", "both")
        if update not in UPDATES:
            raise _rule_error(name, f"update={update!r}; allowed: {sorted(UPDATES)}")
        kinds = set(rule.get("kinds") or KINDS)
        if kinds - KINDS:
            raise _rule_error(name, f"kinds {sorted(kinds - KINDS)} unknown; allowed: "
                                    f"{sorted(KINDS)}")
        patterns = rule.get("modules") or ["*"]
        candidates = layers["parameters"]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(p["module"], pattern) for p in candidates):
                raise _rule_error(name, f"module pattern {pattern!r} matches no layer of the "
                                        f"model (e.g. {candidates[0]['module']!r})")
        blocks = (_block_range(rule["blocks"], len(layers["blocks"]), name)
                  if "blocks" in rule else None)
        matched = [p["name"] for p in candidates
                   if any(fnmatch.fnmatchcase(p["module"], pat) for pat in patterns)
                   and p["kind"] in kinds and p["role"] in UPDATES[update]
                   and (blocks is None or (p["block"] is not None and p["block"] in blocks))]
        if not matched:
            raise _rule_error(name, "selects no parameter (check its modules, kinds, blocks "
                                    "and update together)")
        chosen.update(matched)
    return [p["name"] for p in layers["parameters"] if p["name"] in chosen]
