"""`pock scheme show`: what a scheme selects on the configured model, and what it saves.

Computed in memory from the configuration (no artifacts needed, nothing written): the model is
built and exported, lowered and differentiated as the import, lower and autodiff stages do,
then pruned with the scheme.
"""
from __future__ import annotations

import json

import torch

from pipelines.lora import add_adapters
from pipelines.models import build_model, example_input
from stages.autodiff.optimizers import from_config
from stages.autodiff.training import build_train_step
from stages.importer.layers import describe_layers
from stages.lower.translate import translate
from stages.prune.scheme import rule_matches


def full_step(model_cfg: dict, opt_cfg: dict, lora: dict | None = None,
              seed: int = 0) -> tuple[dict, object, dict]:
    """(layers.json content, full training step, its signature) for a configured model, with
    the LoRA adapters of ``lora`` (pipelines/lora.py), seeded by ``seed``, if given."""
    model = build_model(model_cfg).train()
    if lora:
        add_adapters(model, lora, seed)
    program = torch.export.export(model, (example_input(model_cfg),))
    main, names, origins = translate(program)
    num_params = sum(1 for kind, _ in names.values() if kind == "parameter")
    step, signature = build_train_step(main, num_params, from_config(opt_cfg), origins)
    # Step inputs only, as the lower stage's names.json (constants such as rotary tables are
    # baked into the graph).
    signature["torch_names"] = {v.name: names[v.name][1] for v in main.params[1:]}
    signature["num_params"] = num_params
    return describe_layers(model), step, signature


def shared_full_step(model_cfg: dict, opt_cfg: dict, lora: dict | None, seed: int,
                     full_steps: dict) -> tuple[dict, object, dict]:
    """``full_step``, kept in ``full_steps`` per optimizer and LoRA adapters (the two things a
    full step of one model depends on), so the schemes that share one build it once."""
    key = json.dumps([opt_cfg, lora], sort_keys=True)
    if key not in full_steps:
        full_steps[key] = full_step(model_cfg, opt_cfg, lora, seed)
    return full_steps[key]


def scheme_step(model_cfg: dict, opt_cfg: dict, scheme: dict, seed: int,
                full_steps: dict) -> tuple:
    """(pruned step, signature, report) of ``scheme`` on the configured model, from the full
    step of its optimizer and its LoRA adapters (``shared_full_step``)."""
    from stages.prune.__main__ import prune_scheme

    return prune_scheme(scheme, *shared_full_step(model_cfg, opt_cfg, scheme.get("lora"), seed,
                                                  full_steps))


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render(scheme: dict, layers: dict, summary: dict) -> str:
    shapes = {p["name"]: p["shape"] for p in layers["parameters"]}
    lines = [f"scheme {scheme['name']}"]
    for position, rule in enumerate(scheme["rules"]):
        matches = rule_matches(rule, layers, position)
        lines.append(f"  rule {rule.get('name', f'#{position}')}: {len(matches)} parameters")
        for name, selection in matches:
            shape = shapes[name]
            if selection is None:
                what = "all channels"
            else:
                axis = "output" if selection["axis"] == 0 else "input"
                what = f"{len(selection['index'])} of {shape[selection['axis']]} {axis} channels"
            lines.append(f"    {name:<36} {str(shape):<18} {what}")
    full, pruned = summary["full"], summary["pruned"]
    lines += [
        f"  trainable: {summary['trainable_parameters']} parameters, "
        f"{pruned['trainable_elements']:,} of {full['trainable_elements']:,} elements "
        f"({pruned['trainable_elements'] / full['trainable_elements']:.1%})",
        "",
        f"  {'':<28}{'full BP':>14}{'this scheme':>14}{'ratio':>8}",
    ]
    rows = [("step FLOPs", "flops", "{:,.0f}"), ("backward + update FLOPs", "backward_flops",
                                                "{:,.0f}"),
            ("parameter gradients", "param_grad_bytes", None),
            ("optimizer state", "optimizer_state_bytes", None),
            ("saved activations", "saved_activation_bytes", None)]
    for label, key, fmt in rows:
        a, b = full[key], pruned[key]
        shown = [fmt.format(v) if fmt else _size(v) for v in (a, b)]
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"  {label:<28}{shown[0]:>14}{shown[1]:>14}{ratio:>8}")
    lines.append(f"  backward + update FLOPs saved: "
                 f"{1 - pruned['backward_flops'] / max(1, full['backward_flops']):.1%}; "
                 f"memory for gradients, state and saved activations: "
                 f"{_size(sum(pruned[k] for _, k, f in rows[2:]))} vs "
                 f"{_size(sum(full[k] for _, k, f in rows[2:]))}")
    return "\n".join(lines)
