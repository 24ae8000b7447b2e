"""The configuration resolved once, by the resolve stage, into what each stage reads: the only
reader of params.yaml in the chain.

params.yaml says things once and by name (a case names its model, scheme and optimizer; its lr
and optimize settings override the shared ones; a device extends another). The resolve stage
writes, under artifacts/resolved/, each stage's inputs with every name followed and every
override applied; each stage depends on its own file and reads it back here:

    models/<model>.json           data, weights, import, lower   ModelInputs
    cases/<case>/autodiff.json    autodiff                       AutodiffInputs
    cases/<case>/prune.json       prune                          PruneInputs
    cases/<case>/optimize.json    optimize                       OptimizeInputs
    cases/<case>/evaluate.json    evaluate                       EvaluateInputs
    cases/<case>/measure.json     profile, benchmark             MeasureInputs
    cases/<case>/package.json     package                        PackageInputs
    profiles/<device>.json        tune, build, evaluate, benchmark, package
                                  (pipelines/profiles.py: Profile)
    pretuned/<device>/            tune: device_profiles/tuned/<device>'s records, if any
                                  (so that retuning one device reruns its own tune stages)

A file is rewritten only where its content changes, so a change to params.yaml makes stale
exactly the stages whose inputs it changes (DVC compares the files' hashes).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pipelines.config import (Benchmark, LoRA, Model, Optimizer, Params, Rule, Search,
                              case_optimize, case_optimizer)
from pipelines.io import dumps_json
from pipelines.layout import (pretuned, resolved_case, resolved_model, resolved_pretuned,
                              resolved_profile_path)
from pipelines.profiles import load_profile
from pipelines.schema import HOST, Strict


class ModelInputs(Strict):
    model: Model
    seed: int


class AutodiffInputs(Strict):
    model: str  # whose lowered form the step is built from
    task: str
    optimizer: Optimizer  # at the case's lr
    lora: LoRA | None
    # what a rule with an lr_scale selects steps at the learning rate times it; with statistics
    # trained_layers, the batch norms these rules (or the search's choices) leave frozen keep
    # their statistics
    rules: list[Rule]
    search: Search | None
    statistics: str
    seed: int


class PruneInputs(Strict):
    model: str
    scheme: str
    rules: list[Rule]
    search: Search | None
    # a search fine-tunes candidates in PyTorch: the model, its optimizer and seed
    search_model: Model | None
    optimizer: Optimizer
    seed: int


class OptimizeInputs(Strict):
    reorder_updates: bool
    update_in_place: bool
    recompute: Literal["never", "auto", "always"]
    loss_chunk_rows: int
    frozen_dtype: str
    budgets: dict[str, float]  # bytes the step may plan for, by device that builds the case


class EvaluateInputs(Strict):
    case: str
    model_name: str
    model: Model
    scheme: str
    optimizer_name: str
    optimizer: Optimizer
    lora: LoRA | None
    evaluate: list[str]
    benchmark: Benchmark
    seed: int


class MeasureInputs(Strict):
    benchmark: Benchmark
    seed: int
    # PyTorch's peers in a device's container (runners/docker.py: docker.peers) train the model
    model: Model
    optimizer: Optimizer


class PackageInputs(Strict):
    trial_steps: int
    seed: int


STAGES = {"autodiff": AutodiffInputs, "prune": PruneInputs, "optimize": OptimizeInputs,
          "evaluate": EvaluateInputs, "measure": MeasureInputs, "package": PackageInputs}


def resolve(params: Params) -> dict[Path, str | bytes]:
    """Every resolved file's content, by its path: each device profile and its committed
    tuning records, each model's and each case's stage inputs. Bad input is a ConfigError (a
    profile that does not check)."""
    profiles = {name: load_profile(name, params.profiles) for name in [HOST, *params.devices]}
    files = {resolved_profile_path(name): profile.model_dump()
             for name, profile in profiles.items()}
    for name in profiles:
        committed = sorted(pretuned(name).glob("*.gz"))
        files |= {resolved_pretuned(name) / f.name: f.read_bytes() for f in committed}
        files[resolved_pretuned(name) / "README"] = (
            f"device_profiles/tuned/{name}: {len(committed) and 'the' or 'no'} committed "
            "tuning records (pock pretuned)\n")
    for name, model in params.models.items():
        files[resolved_model(name)] = ModelInputs(model=model, seed=params.seed)
    for name, case in params.cases.items():
        scheme, model = params.schemes[case.scheme], params.models[case.model]
        optimizer, settings = case_optimizer(params, case), case_optimize(params, case)
        devices = [HOST, *(params.devices if name in params.deploy else [])]
        inputs = {
            "autodiff": AutodiffInputs(
                model=case.model, task=model.task, optimizer=optimizer, lora=scheme.lora,
                rules=scheme.rules, search=scheme.search, statistics=scheme.statistics,
                seed=params.seed),
            "prune": PruneInputs(model=case.model, scheme=case.scheme, rules=scheme.rules,
                                 search=scheme.search,
                                 search_model=model if scheme.search else None,
                                 optimizer=optimizer, seed=params.seed),
            "optimize": OptimizeInputs(reorder_updates=settings.reorder_updates,
                                       update_in_place=settings.update_in_place,
                                       recompute=settings.recompute,
                                       loss_chunk_rows=settings.loss_chunk_rows,
                                       frozen_dtype=settings.frozen_dtype,
                                       budgets={d: profiles[d].budget_bytes for d in devices}),
            "evaluate": EvaluateInputs(case=name, model_name=case.model, model=model,
                                       scheme=case.scheme, optimizer_name=case.optimizer,
                                       optimizer=optimizer, lora=scheme.lora,
                                       evaluate=case.evaluate, benchmark=params.benchmark,
                                       seed=params.seed),
            "measure": MeasureInputs(benchmark=params.benchmark, seed=params.seed, model=model,
                                     optimizer=optimizer),
            "package": PackageInputs(trial_steps=params.package.trial_steps, seed=params.seed),
        }
        for stage, value in inputs.items():
            files[resolved_case(name, stage)] = value
    return {path: value if isinstance(value, (str, bytes)) else dumps_json(
        value if isinstance(value, dict) else value.model_dump()) for path, value in files.items()}


def model_inputs(model: str) -> ModelInputs:
    return ModelInputs.model_validate_json(resolved_model(model).read_text())


def case_inputs(case: str, stage: str):
    """The resolved inputs of ``stage`` (a key of STAGES) for ``case``."""
    return STAGES[stage].model_validate_json(resolved_case(case, stage).read_text())
