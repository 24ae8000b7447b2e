"""Searching what to update: measured contributions, compiler-measured costs, a budget.

The paper's "searching important layers", after tiny training's contribution analysis:
1. Candidates: the weight of every layer of the kinds ``search.kinds`` in the blocks
   ``search.blocks``, each at every channel ratio in ``search.ratios`` (output channels).
2. Contribution: fine-tune the base rules (``search.base``, e.g. the classifier) plus one
   candidate, alone, for ``search.steps`` steps in PyTorch from the pre-trained weights on
   four fifths of the fine-tuning training split. Contribution = the base's mean training
   loss over the run - the candidate's (the loss drop it adds). Every run sees the same
   batches in the same order, so this is a paired comparison; the loss at a single point,
   e.g. on held-out data at the end, swings with the last few batches (measured: drops of
   +-0.1 with no pattern for 150 steps). The held-out fifth's loss is recorded beside it.
3. Cost: the training memory a scheme controls - parameter gradients, optimizer state and
   the activations saved for backward - as the compiler's own pruned step has them
   (stages/prune), for the base plus the candidate, minus the base's.
4. Choice: candidates by contribution per byte, at most one ratio per layer, only those that
   help; each is added if the whole chosen scheme, pruned again, still fits ``budget_mb``.
"""
from __future__ import annotations

import numpy as np
import torch

from pipelines.config import ConfigError
from pipelines.models import build_model
from pipelines.progress import progress
from pipelines.torch_ref import batches, make_optimizer, seed_everything, train_step
from stages.prune.__main__ import prune_scheme
from stages.prune.scheme import KINDS, rule_matches, select

COST_KEYS = ("param_grad_bytes", "optimizer_state_bytes", "saved_activation_bytes")
SOURCE = "params.yaml (search)"


def memory_cost(summary: dict) -> int:
    return sum(summary["pruned"][k] for k in COST_KEYS)


def candidates(cfg: dict, layers: dict) -> list[dict]:
    kinds = list(cfg["kinds"])
    if set(kinds) - KINDS:
        raise ConfigError(f"{SOURCE}: kinds {sorted(set(kinds) - KINDS)} unknown; allowed: "
                          f"{sorted(KINDS)}")
    ratios = [float(r) for r in cfg["ratios"]]
    if not ratios or not all(0 < r <= 1 for r in ratios):
        raise ConfigError(f"{SOURCE}: ratios={cfg['ratios']!r}; allowed: values in (0, 1]")
    rule = {"name": "search candidates", "kinds": kinds, "update": "weight"}
    if cfg.get("blocks"):
        rule["blocks"] = dict(cfg["blocks"])
    modules = [param.removesuffix(".weight") for param, _ in rule_matches(rule, layers, 0)]
    return [{"module": m, "ratio": r} for m in modules for r in sorted(ratios)]


def candidate_rule(candidate: dict) -> dict:
    rule = {"name": f"{candidate['module']} x{candidate['ratio']:g}",
            "modules": [candidate["module"]], "update": "weight"}
    if candidate["ratio"] < 1:
        rule["channels"] = candidate["ratio"]
    return rule


class Probe:
    """Short PyTorch fine-tuning runs from the pre-trained weights, scored on held-out data."""

    def __init__(self, model_cfg: dict, opt_cfg: dict, weights: dict, data, layers: dict,
                 steps: int, seed: int):
        x, y = data["finetune_train_x"], data["finetune_train_y"]
        cut = len(x) * 4 // 5
        self.train, self.held_out = (x[:cut], y[:cut]), (torch.from_numpy(x[cut:]),
                                                         torch.from_numpy(y[cut:]))
        self.model_cfg, self.opt_cfg, self.weights = model_cfg, opt_cfg, weights
        self.layers, self.steps, self.seed = layers, steps, seed
        if steps < 1:
            raise ConfigError(f"{SOURCE}: steps={steps}; allowed: 1 or more")

    def loss_after(self, scheme: dict) -> tuple[float, float]:
        """(mean training loss over the run, held-out loss at its end) for ``scheme``. Every
        run sees the same batches in the same order, so training losses compare pairwise."""
        seed_everything(self.seed)
        model = build_model(self.model_cfg).train()
        model.load_state_dict(self.weights)
        optimizer = make_optimizer(model, self.opt_cfg, select(scheme, self.layers))
        batch, (x, y) = int(self.model_cfg["batch_size"]), self.train
        losses, epoch = [], 0
        while len(losses) < self.steps:
            for index in batches(len(x), batch, self.seed, epoch):
                if len(losses) == self.steps:
                    break
                losses.append(train_step(model, optimizer, torch.from_numpy(x[index]),
                                         torch.from_numpy(y[index])))
            epoch += 1
        model.eval()
        with torch.no_grad():
            held_out = float(torch.nn.functional.cross_entropy(model(self.held_out[0]),
                                                               self.held_out[1]))
        train = float(np.mean(losses))
        return (train if np.isfinite(train) else float("inf"),
                held_out if np.isfinite(held_out) else float("inf"))


def search(cfg: dict, budget_mb: float, probe: Probe, layers: dict, full, signature: dict,
           name: str, log=print) -> tuple[dict, dict]:
    """(the chosen scheme, a table: the base's loss and cost, the chosen scheme's cost, and one
    row per candidate with its loss drop, cost and whether it was chosen)."""
    if not budget_mb or budget_mb <= 0:
        raise ConfigError(f"{SOURCE}: budget_mb={budget_mb!r}; allowed: a positive number")
    budget = budget_mb * 2**20
    base_rules = [dict(r) for r in cfg["base"]]
    base = {"name": name, "rules": base_rules}
    base_cost = memory_cost(prune_scheme(base, layers, full, signature)[2])
    if base_cost > budget:
        raise ConfigError(f"{SOURCE}: budget_mb={budget_mb} is below what the base rules alone "
                          f"need ({base_cost / 2**20:.3f} MiB)")
    base_loss, base_held_out = probe.loss_after(base)
    rows = []
    for i, candidate in enumerate(progress(candidates(cfg, layers), "search candidates")):
        scheme = {"name": name, "rules": base_rules + [candidate_rule(candidate)]}
        summary = prune_scheme(scheme, layers, full, signature)[2]
        loss, held_out = probe.loss_after(scheme)
        cost = memory_cost(summary) - base_cost
        rows.append(dict(candidate, loss=loss, contribution=base_loss - loss,
                         held_out_loss=held_out, cost_bytes=cost, chosen=False))
        log(f"[{i + 1}] {candidate['module']} x{candidate['ratio']:g}: loss drop "
            f"{base_loss - loss:+.4f}, +{cost / 2**10:.1f} KiB")
    chosen_rules, taken = [], set()
    for row in sorted(rows, key=lambda r: -r["contribution"] / max(r["cost_bytes"], 1)):
        if row["contribution"] <= 0 or row["module"] in taken:
            continue
        trial = {"name": name, "rules": base_rules + chosen_rules + [candidate_rule(row)]}
        if memory_cost(prune_scheme(trial, layers, full, signature)[2]) <= budget:
            chosen_rules.append(candidate_rule(row))
            taken.add(row["module"])
            row["chosen"] = True
    scheme = {"name": name, "rules": base_rules + chosen_rules}
    cost = memory_cost(prune_scheme(scheme, layers, full, signature)[2])
    return scheme, {"budget_mb": budget_mb, "base_loss": base_loss,
                    "base_held_out_loss": base_held_out, "base_cost_bytes": base_cost,
                    "chosen_cost_bytes": cost, "candidates": rows}
