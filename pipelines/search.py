"""Searching what to update: measured contributions, compiler-measured costs, a budget.

The paper's "searching important layers", after tiny training's contribution analysis, for a
scheme with a ``search`` section (conf/sparse/searched.yaml; prune@<case> runs it):
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
   (compile.prune), for the base plus the candidate, minus the base's.
4. Choice: candidates by contribution per byte, at most one ratio per layer, only those that
   help; each is added if the whole chosen scheme, pruned again, still fits ``budget_mb``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipelines.analysis.cost import scheme_report
from pipelines.compile import prune
from pipelines.schema import ConfigError
from pipelines.data import split
from pipelines.frontends import load_module
from pipelines.ir import signature_of
from pipelines.models.pytorch import (batches, hold_statistics, make_optimizer, one_thread,
                                      seed_everything, train_step)
from pipelines.progress import progress
from pipelines.training.scheme import lr_scales, rule_matches, select

COST_KEYS = ("param_grad_bytes", "optimizer_state_bytes", "saved_activation_bytes")
SOURCE = "params.yaml (schemes.<name>.search)"


def memory_cost(summary: dict) -> int:
    return sum(summary["pruned"][k] for k in COST_KEYS)


def cost_of(rules: list, layers: dict, full) -> int:
    """The training memory ``rules`` control, from the compiler's own pruned step."""
    return memory_cost(scheme_report(full, prune(full, select(rules, layers), "search")))


def candidates(cfg, layers: dict) -> list[dict]:
    rule = {"name": "search candidates", "kinds": list(cfg.kinds), "update": "weight"}
    if cfg.blocks:
        rule["blocks"] = dict(cfg.blocks)
    modules = [param.removesuffix(".weight") for param, _ in rule_matches(rule, layers, 0)]
    return [{"module": m, "ratio": r} for m in modules for r in sorted(cfg.ratios)]


def search_space(cfg, layers: dict) -> list[dict]:
    """Rules selecting everything the search may choose: its base and every candidate whole."""
    return ([r.model_dump(exclude_none=True) for r in cfg.base]
            + [candidate_rule({"module": c["module"], "ratio": 1.0})
               for c in candidates(cfg, layers)])


def candidate_rule(candidate: dict) -> dict:
    rule = {"name": f"{candidate['module']} x{candidate['ratio']:g}",
            "modules": [candidate["module"]], "update": "weight"}
    if candidate["ratio"] < 1:
        rule["channels"] = candidate["ratio"]
    return rule


class Probe:
    """Short PyTorch fine-tuning runs from the pre-trained weights, scored on held-out data."""

    def __init__(self, model, optimizer, weights: dict, data: dict, layers: dict, steps: int,
                 seed: int, frozen_statistics: list[str] = ()):
        _, example = load_module(model)
        xs, y = split(data, "finetune_train", list(example))  # forward's names
        cut = len(y) * 4 // 5
        self.train = ([a[:cut] for a in xs], y[:cut])
        self.held_out = ([torch.from_numpy(a[cut:]) for a in xs], torch.from_numpy(y[cut:]))
        self.model, self.optimizer, self.weights = model, optimizer, weights
        self.layers, self.steps, self.seed = layers, steps, seed
        self.frozen_statistics = frozen_statistics  # the batch norms the compiled step holds

    @one_thread()  # the same losses, so the same choice, on any core count
    def loss_after(self, rules: list) -> tuple[float, float]:
        """(mean training loss over the run, held-out loss at its end) for a scheme's
        ``rules``. Every run sees the same batches in the same order, so training losses
        compare pairwise."""
        seed_everything(self.seed)
        model, _ = load_module(self.model)
        model.load_state_dict(self.weights)
        hold_statistics(model.train(), self.frozen_statistics)
        optimizer = make_optimizer(model, self.optimizer, select(rules, self.layers),
                                   lr_scales(rules, self.layers))
        batch, (xs, y) = self.model.batch_size, self.train
        losses, epoch = [], 0
        while len(losses) < self.steps:
            for index in batches(len(y), batch, self.seed, epoch):
                if len(losses) == self.steps:
                    break
                losses.append(train_step(model, optimizer, *(a[index] for a in xs), y[index]))
            epoch += 1
        model.eval()
        with torch.no_grad():
            held_out = float(torch.nn.functional.cross_entropy(model(*self.held_out[0]),
                                                               self.held_out[1]))
        train = float(np.mean(losses))
        return (train if np.isfinite(train) else float("inf"),
                held_out if np.isfinite(held_out) else float("inf"))


def search(cfg, probe: Probe, layers: dict, full, log=print) -> tuple[list[dict], dict]:
    """(the chosen rules, a table: the base's loss and cost, the chosen scheme's cost, and one
    row per candidate with its loss drop, cost and whether it was chosen). ``cfg``: a
    pipelines/config.py Search; ``full``: the full step (a module with its signature)."""
    budget = cfg.budget_mb * 2**20
    base_rules = [r.model_dump(exclude_none=True) for r in cfg.base]
    base_cost = cost_of(base_rules, layers, full)
    if base_cost > budget:
        raise ConfigError(f"{SOURCE}: budget_mb={cfg.budget_mb} is below what the base rules "
                          f"alone need ({base_cost / 2**20:.3f} MiB)")
    base_loss, base_held_out = probe.loss_after(base_rules)
    rows = []
    for i, candidate in enumerate(progress(candidates(cfg, layers), "search candidates")):
        rules = base_rules + [candidate_rule(candidate)]
        loss, held_out = probe.loss_after(rules)
        cost = cost_of(rules, layers, full) - base_cost
        rows.append(dict(candidate, loss=loss, contribution=base_loss - loss,
                         held_out_loss=held_out, cost_bytes=cost, chosen=False))
        log(f"[{i + 1}] {candidate['module']} x{candidate['ratio']:g}: loss drop "
            f"{base_loss - loss:+.4f}, +{cost / 2**10:.1f} KiB")
    chosen_rules, taken = [], set()
    for row in sorted(rows, key=lambda r: -r["contribution"] / max(r["cost_bytes"], 1)):
        if row["contribution"] <= 0 or row["module"] in taken:
            continue
        trial = base_rules + chosen_rules + [candidate_rule(row)]
        if cost_of(trial, layers, full) <= budget:
            chosen_rules.append(candidate_rule(row))
            taken.add(row["module"])
            row["chosen"] = True
    rules = base_rules + chosen_rules
    return rules, {"budget_mb": cfg.budget_mb, "base_loss": base_loss,
                   "base_held_out_loss": base_held_out, "base_cost_bytes": base_cost,
                   "chosen_cost_bytes": cost_of(rules, layers, full), "candidates": rows}


def search_rules(cfg, model, optimizer, weights: Path, data: Path, layers: dict, full,
                 seed: int) -> tuple[list[dict], dict]:
    """``search`` for a torch model whose pre-trained weights and data are in ``weights`` (a
    safetensors file) and ``data`` (an .npz of pipelines/data)."""
    from pipelines.frontends.weights import load_weights
    from pipelines.io import load_arrays

    if not model.in_pytorch or not data.exists():
        raise ConfigError(f"{SOURCE}: searching a scheme fine-tunes candidates in PyTorch on the "
                          "model's data; this model has frontend "
                          f"{model.frontend!r}{'' if data.exists() else ' and no data'}")
    probe = Probe(model, optimizer, load_weights(weights), load_arrays(data), layers, cfg.steps,
                  seed, signature_of(full).get("frozen_statistics", []))
    return search(cfg, probe, layers, full, log=lambda line: print(line, flush=True))
