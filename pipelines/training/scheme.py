"""Sparse-update schemes: which parameters, and which of their channels, fine-tuning updates.

A scheme (conf/sparse/<name>.yaml) is a list of rules; a parameter is updated when any rule
selects it. A rule selects by
  modules:  patterns on the module path, in the model's own names (a PyTorch state dict's, a
            Hugging Face model's, an ONNX file's): globs ("features.*.conv.0.0", "classifier.*")
            or regular expressions prefixed "re:" ("re:features\\.1[0-7]\\.conv\\.0\\.0")
  kinds:    layer kinds (conv, conv_pointwise, conv_depthwise, linear, norm, embedding);
            optional
  blocks:   {first: k} or {last: k} of the model's repeated blocks; optional
  update:   weight, bias or both (a norm layer's scale counts as its weight, its shift as bias)
  channels: optional; a ratio 0 < r <= 1 (the first ceil(r * C) channels) or a list of channel
            indices: only those channels are updated, and only their gradient is computed
  axis:     output (default) or input: which channels ``channels`` counts. A bias or norm
            parameter has output channels only; with axis input it is updated whole.
"""
from __future__ import annotations

import math

from pipelines.schema import ConfigError
from pipelines.patterns import module_matcher

# "other": a parameter of no layer kind above (e.g. a scale a model multiplies by itself).
KINDS = {"conv", "conv_pointwise", "conv_depthwise", "linear", "norm", "embedding", "other"}
UPDATES = {"weight": {"weight"}, "bias": {"bias"}, "both": {"weight", "bias"}}
AXES = {"output": 0, "input": 1}
RULE_KEYS = {"name", "modules", "kinds", "blocks", "update", "channels", "axis", "lr_scale"}
SOURCE = "params.yaml (schemes, from conf/sparse)"


def _rule_error(rule_name: str, message: str) -> ConfigError:
    return ConfigError(f"{SOURCE}: rule {rule_name!r}: {message}")


def _as_dict(rule) -> dict:
    """A rule as a dict (a pipelines/config.py Rule, or a dict already), unset keys left out."""
    return rule if isinstance(rule, dict) else rule.model_dump(exclude_none=True,
                                                              exclude_defaults=True)


def _listed(names: list[str], limit: int = 12) -> str:
    unique = list(dict.fromkeys(names))
    return ", ".join(unique[:limit]) + (f", ... ({len(unique)} in all)"
                                        if len(unique) > limit else "")


def _block_range(blocks: dict, count: int, rule_name: str) -> range:
    if not isinstance(blocks, dict) or len(blocks) != 1 or next(iter(blocks)) not in ("first",
                                                                                      "last"):
        raise _rule_error(rule_name, f"blocks={blocks!r}; allowed: {{first: k}} or {{last: k}}")
    (where, k), = blocks.items()
    if not isinstance(k, int) or not 1 <= k <= count:
        raise _rule_error(rule_name, f"blocks.{where}={k!r}; allowed: 1..{count} "
                                     f"(the model has {count} blocks)")
    return range(0, k) if where == "first" else range(count - k, count)


def _matcher(pattern: str, rule_name: str):
    try:
        return module_matcher(pattern)
    except ValueError as err:
        raise _rule_error(rule_name, str(err)) from None


def _channels(rule: dict, param: dict, axis: int, rule_name: str) -> list[int] | None:
    """Channel indices ``rule`` selects of ``param`` along ``axis``; None for all of them."""
    spec = rule.get("channels")
    if spec is None or axis >= len(param["shape"]):
        return None
    if "layout" in param:  # the channel engine slices PyTorch layouts (OIHW, [out, in])
        raise _rule_error(rule_name, f"channels on {param['name']!r}: its kernel has the "
                                     f"{param['layout']} layout; channel selection needs "
                                     "PyTorch's (select the whole tensor instead)")
    if param["kind"] == "conv_depthwise" and axis == 1:
        raise _rule_error(rule_name, f"axis=input on depthwise conv {param['module']!r}: it has "
                                     "one input channel per group; use axis: output")
    count = param["shape"][axis]
    if isinstance(spec, bool) or not isinstance(spec, (int, float, list)):
        raise _rule_error(rule_name, f"channels={spec!r}; allowed: a ratio 0 < r <= 1 or a "
                                     "list of channel indices")
    if isinstance(spec, list):
        if not spec or not all(isinstance(c, int) and not isinstance(c, bool) for c in spec):
            raise _rule_error(rule_name, f"channels={spec!r}; a channel list holds integers")
        bad = [c for c in spec if not 0 <= c < count]
        if bad:
            raise _rule_error(rule_name, f"channels {bad} out of range for {param['name']!r} "
                                         f"({count} channels on axis {axis})")
        index = sorted(set(spec))
    else:
        if not 0 < spec <= 1:
            raise _rule_error(rule_name, f"channels={spec!r}; a ratio must be in (0, 1]")
        index = list(range(max(1, math.ceil(spec * count - 1e-9))))
    return None if len(index) == count else index


def rule_matches(rule: dict, layers: dict, position: int) -> list[tuple[str, dict | None]]:
    """(parameter name, channel selection or None) for every parameter ``rule`` selects; a rule
    that selects nothing is an error naming it and the modules it could match."""
    rule = _as_dict(rule)
    name = rule.get("name", f"#{position}")
    unknown = set(rule) - RULE_KEYS
    if unknown:
        raise _rule_error(name, f"unknown keys {sorted(unknown)}; allowed: {sorted(RULE_KEYS)}")
    update = rule.get("update", "both")
    if update not in UPDATES:
        raise _rule_error(name, f"update={update!r}; allowed: {sorted(UPDATES)}")
    kinds = set(rule.get("kinds") or KINDS)
    if kinds - KINDS:
        raise _rule_error(name, f"kinds {sorted(kinds - KINDS)} unknown; allowed: "
                                f"{sorted(KINDS)}")
    axis_name = rule.get("axis", "output")
    if axis_name not in AXES:
        raise _rule_error(name, f"axis={axis_name!r}; allowed: {sorted(AXES)}")
    patterns = rule.get("modules") or ["*"]
    candidates = layers["parameters"]
    matchers = []
    for pattern in patterns:
        match = _matcher(str(pattern), name)
        if not any(match(p["module"]) for p in candidates):
            raise _rule_error(name, f"module pattern {pattern!r} matches no layer of the "
                                    f"model; its modules: "
                                    f"{_listed([p['module'] for p in candidates])}")
        matchers.append(match)
    blocks = (_block_range(rule["blocks"], len(layers["blocks"]), name)
              if "blocks" in rule else None)
    matched = [(p["name"], _channels(rule, p, AXES[axis_name], name)) for p in candidates
               if any(match(p["module"]) for match in matchers)
               and p["kind"] in kinds and p["role"] in UPDATES[update]
               and (blocks is None or (p["block"] is not None and p["block"] in blocks))]
    if not matched:  # what its module patterns did match, so the kind or role to ask is plain
        seen = sorted({f"{p['module']} ({p['kind']}, {p['role']})" for p in candidates
                       if any(match(p["module"]) for match in matchers)})
        raise _rule_error(name, "selects no parameter (check its modules, kinds, blocks "
                                "and update together); its modules match: "
                                f"{_listed(seen)}")
    return [(p, None if index is None else {"axis": AXES[axis_name], "index": index})
            for p, index in matched]


def select(rules: list, layers: dict) -> dict[str, dict | None]:
    """What a scheme's ``rules`` update, in model order: parameter name (the model's own) ->
    None (the whole tensor) or {"axis": 0 or 1, "index": [channels]}.

    ``layers`` is the import stage's layers.json. Rules add up: a parameter one rule selects
    whole is updated whole; channel lists of two rules on the same axis are merged."""
    rules = [_as_dict(rule) for rule in rules]
    if not rules:
        raise ConfigError(f"{SOURCE}: a scheme has no rules")
    chosen: dict[str, dict | None] = {}
    chosen_by: dict[str, str] = {}
    for position, rule in enumerate(rules):
        for param, selection in rule_matches(rule, layers, position):
            rule_name = rule.get("name", f"#{position}")
            if param not in chosen or chosen[param] is None or selection is None:
                chosen[param] = None if param in chosen else selection
                chosen_by.setdefault(param, rule_name)
                continue
            if chosen[param]["axis"] != selection["axis"]:
                raise _rule_error(rule_name, f"selects channels of {param!r} on another axis "
                                             f"than rule {chosen_by[param]!r} does")
            chosen[param] = dict(selection, index=sorted(set(chosen[param]["index"])
                                                         | set(selection["index"])))
    shapes = {p["name"]: p["shape"] for p in layers["parameters"]}
    for param, selection in chosen.items():  # merged lists may cover every channel
        if selection and len(selection["index"]) == shapes[param][selection["axis"]]:
            chosen[param] = None
    return {p["name"]: chosen[p["name"]] for p in layers["parameters"] if p["name"] in chosen}


def lr_scales(rules: list, layers: dict) -> dict[str, float]:
    """The learning-rate scale of every parameter a rule with an ``lr_scale`` selects (the
    model's names): its update takes the case's learning rate times it. Rules without one
    leave a parameter at 1 unless another gives it one; two different scales are an error."""
    scales: dict[str, float] = {}
    given_by: dict[str, str] = {}
    for position, rule in enumerate(_as_dict(rule) for rule in rules):
        scale = rule.get("lr_scale")
        if scale is None:
            continue
        rule_name = rule.get("name", f"#{position}")
        for param, _ in rule_matches(rule, layers, position):
            if scales.setdefault(param, scale) != scale:
                raise _rule_error(rule_name, f"gives {param!r} lr_scale {scale}, rule "
                                             f"{given_by[param]!r} gives it {scales[param]}")
            given_by.setdefault(param, rule_name)
    return scales
