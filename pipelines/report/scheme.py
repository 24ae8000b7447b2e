"""`pock scheme show`: what a case's scheme selects, rule by rule, and what it saves against full
backpropagation (from its prune stage's files)."""
from __future__ import annotations

from pipelines.training.scheme import rule_matches


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render_scheme(name: str, rules: list[dict], layers: dict, report: dict) -> str:
    shapes = {p["name"]: p["shape"] for p in layers["parameters"]}
    lines = [f"case {name}: scheme {report['scheme']}"]
    for position, rule in enumerate(rules):
        matches = rule_matches(rule, layers, position)
        lines.append(f"  rule {rule.get('name', f'#{position}')}: {len(matches)} parameters")
        for param, selection in matches:
            shape = shapes[param]
            if selection is None:
                what = "all channels"
            else:
                axis = "output" if selection["axis"] == 0 else "input"
                what = f"{len(selection['index'])} of {shape[selection['axis']]} {axis} channels"
            lines.append(f"    {param:<40} {str(shape):<18} {what}")
    full, pruned = report["full"], report["pruned"]
    lines += [
        f"  trainable: {report['trainable_parameters']} parameters, "
        f"{pruned['trainable_elements']:,} of {full['trainable_elements']:,} elements "
        f"({pruned['trainable_elements'] / full['trainable_elements']:.1%})",
        "",
        f"  {'':<28}{'full BP':>14}{'this scheme':>14}{'ratio':>8}",
    ]
    rows = [("step FLOPs", "flops", "{:,.0f}"),
            ("backward + update FLOPs", "backward_flops", "{:,.0f}"),
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
