"""The configuration every stage reads: params.yaml (composed from conf/ by Hydra: `pock compose`
or `dvc exp run -S ...`), checked against the schema below before any artifact moves.

A wrong type, an unknown key or a name that refers to nothing is a ``ConfigError`` naming the key,
the conf/ file it came from and what is allowed. Stages exit 2 on it (``run_stage``).

params.yaml holds:
    models      name -> Model        conf/model/<name>.yaml, the ones the experiment uses
    schemes     name -> Scheme       conf/sparse/<name>.yaml, every one
    optimizers  name -> Optimizer    conf/optimizer/<name>.yaml, every one
    cases       name -> Case         conf/experiment/<name>.yaml: what the chain compiles
    deploy, devices                  the cases built for each device besides the host
    optimize, benchmark, package, regress, profiles, seed   conf/config.yaml
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt,
                      PositiveFloat, PositiveInt, ValidationError, model_validator)

from pipelines.io import ROOT

PARAMS = ROOT / "params.yaml"
CONF = ROOT / "conf"
HOST = "host"
# Case, model and device names become DVC stage names (`build@<case>`, `tune@<case>-<device>`)
# and paths: no dots (params keys), dashes (matrix names) or slashes.
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# What a model is trained to do, which sets the loss and the labels (training/loss.py).
TASKS = ("classification", "causal_lm", "masked_lm", "regression")
IGNORE_INDEX = -100  # a label that scores nothing (PyTorch's and transformers' convention)


class ConfigError(Exception):
    """Bad user input: the message names the file, the key and what is allowed."""


class Strict(BaseModel):
    """A config section: unknown keys are errors that list the allowed ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = set(data) - set(cls.model_fields)
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}; allowed: "
                                 f"{sorted(cls.model_fields)}")
        return data


Kind = Literal["conv", "conv_pointwise", "conv_depthwise", "linear", "norm", "embedding", "other"]


class Rule(Strict):
    """One rule of a scheme (pipelines/training/scheme.py says how rules select)."""

    name: str | None = None
    modules: list[str] | None = None
    kinds: list[Kind] | None = None
    blocks: dict[Literal["first", "last"], PositiveInt] | None = None
    update: Literal["weight", "bias", "both"] = "both"
    channels: PositiveFloat | list[NonNegativeInt] | None = None
    axis: Literal["output", "input"] = "output"


class LoRA(Strict):
    """Rank-r adapters beside linear projections (pipelines/training/lora.py)."""

    rank: PositiveInt
    alpha: PositiveFloat | None = None  # default: rank (scale 1)
    modules: list[str] = Field(min_length=1)
    export: Literal["separate", "merged"] = "separate"

    @property
    def scale(self) -> float:
        return (self.alpha or self.rank) / self.rank


class Search(Strict):
    """Search a scheme under a memory budget (pipelines/evaluate/search.py)."""

    budget_mb: PositiveFloat
    base: list[Rule]
    kinds: list[Kind]
    blocks: dict[Literal["first", "last"], PositiveInt] | None = None
    ratios: list[Annotated[float, Field(gt=0, le=1)]] = Field(min_length=1)
    steps: PositiveInt


class Scheme(Strict):
    """What fine-tuning updates: rules, or a search that finds them; optionally LoRA adapters."""

    rules: list[Rule] = []
    lora: LoRA | None = None
    search: Search | None = None

    @model_validator(mode="after")
    def _rules_or_search(self):
        if bool(self.rules) == bool(self.search):
            raise ValueError("a scheme has rules, or a search that finds them (search:), not "
                             "both and not neither")
        return self


class SGD(Strict):
    """torch.optim.SGD (dampening 0)."""

    kind: Literal["sgd"]
    lr: PositiveFloat
    momentum: NonNegativeFloat = 0.0
    nesterov: bool = False
    weight_decay: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self):
        if self.nesterov and not self.momentum:
            raise ValueError("nesterov needs momentum > 0")
        return self


class Adam(Strict):
    """torch.optim.Adam, or AdamW (decoupled weight decay)."""

    kind: Literal["adam", "adamw"]
    lr: PositiveFloat
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


Optimizer = Annotated[Union[SGD, Adam], Field(discriminator="kind")]


class Digits(Strict):
    """scikit-learn's digits, upsampled: pre-train on some classes, fine-tune on the others."""

    kind: Literal["digits"]
    image_size: PositiveInt
    channels: PositiveInt
    pretrain_classes: list[NonNegativeInt] = Field(min_length=1)
    finetune_classes: list[NonNegativeInt] = Field(min_length=1)
    test_fraction: Annotated[float, Field(gt=0, lt=1)]


class Sentences(Strict):
    """Synthetic review sentences with a sentiment label (pipelines/data/sentences.py)."""

    kind: Literal["sentences"]
    seq_len: PositiveInt
    train_sentences: PositiveInt
    test_sentences: PositiveInt


class Tokens(Strict):
    """Seeded random tokens and next-token labels: synthetic, for speed only."""

    kind: Literal["tokens"]
    vocab: PositiveInt
    seq_len: PositiveInt
    examples: PositiveInt


Data = Annotated[Union[Digits, Sentences, Tokens], Field(discriminator="kind")]


class Pretrain(Strict):
    """PyTorch pre-training on the data's pretrain split (SGD), before any case fine-tunes."""

    epochs: PositiveInt
    batch_size: PositiveInt
    lr: PositiveFloat
    momentum: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    keep_initial: list[str] = []  # module patterns left at their initial values (a new head)
    kind: Literal["sgd"] = "sgd"  # read as an optimizer (models/torch_twin.py)
    nesterov: bool = False


class Finetune(Strict):
    epochs: PositiveInt


class Model(Strict):
    """Where a model comes from and what it is trained on (conf/model/<name>.yaml)."""

    frontend: Literal["torch", "transformers", "onnx", "jax", "keras"]
    source: str  # a file (transformers: a directory), relative to the repository root
    entry: str | None = None  # torch, jax: the function in ``source`` that builds the model
    kwargs: dict[str, Any] = {}  # passed to ``entry``
    # transformers (frontends/transformers.py): the model class (default: config.json's
    # ``architectures``), keys of config.json to override, the step's inputs by name
    architecture: str | None = None
    config: dict[str, Any] = {}
    inputs: list[str] = []
    batch_size: PositiveInt
    # onnx: sizes of the inputs' symbolic dimensions other than the batch, by the names the
    # export gave them ({sequence: 128}); a compiled step has static shapes
    dims: dict[str, PositiveInt] = {}
    data: Data | None = None  # none: the model is compiled and timed, not trained on data
    pretrain: Pretrain | None = None
    finetune: Finetune | None = None
    blocks: list[str] = []  # module-path patterns of the repeated blocks (files' models)
    # the loss and labels (training/loss.py): classification [B, C] logits, class labels;
    # causal_lm / masked_lm [B, S, V] logits, a token label per position; regression: MSE
    task: Literal[TASKS] = "classification"

    @model_validator(mode="after")
    def _entry(self):
        # torch.export.save's files (frontends/torch_module.py): the program is the model
        program = self.frontend == "torch" and Path(self.source).suffix == ".pt2"
        if program and (self.entry or self.kwargs or self.pretrain):
            given = [k for k in ("entry", "kwargs", "pretrain") if getattr(self, k)]
            raise ValueError(f"source {self.source!r} is a saved torch.export program: it takes "
                             f"no {' or '.join(given)} (entry and kwargs build a model from a "
                             "Python file; pretrain scores in eval mode, which a program lacks)")
        if self.frontend != "transformers" and (self.architecture or self.config or self.inputs):
            raise ValueError("architecture, config and inputs are keys of frontend "
                             f"transformers; this model's frontend is {self.frontend}")
        if self.frontend == "transformers" and (self.entry or self.kwargs):
            raise ValueError("frontend transformers builds the model from source's config.json "
                             "(architecture, config): it takes no entry or kwargs")
        if self.frontend in ("torch", "jax") and not self.entry and not program:
            raise ValueError(f"frontend {self.frontend} needs entry: the function in source "
                             "that builds the model (or, for torch, a .pt2 program as source)")
        return self

    @property
    def in_pytorch(self) -> bool:
        """Whether the model is a PyTorch module (torch and transformers frontends): it is
        exported with torch.export and PyTorch trains its twin."""
        return self.frontend in ("torch", "transformers")


class OptimizeOverride(Strict):
    reorder_updates: bool | None = None
    recompute: Literal["never", "auto", "always"] | None = None


class Case(Strict):
    """One thing the chain compiles: a model, a scheme and an optimizer."""

    model: str
    scheme: str
    optimizer: str
    lr: PositiveFloat | None = None  # instead of the optimizer's
    optimize: OptimizeOverride | None = None  # instead of the global `optimize`
    # what evaluate@<case> measures: speed and memory against PyTorch; fine-tuning quality
    evaluate: list[Literal["speed", "finetune"]] = ["speed"]


class Optimize(Strict):
    reorder_updates: bool
    recompute: Literal["never", "auto", "always"]


Peer = Literal["torch_eager_full", "torch_eager_frozen", "torch_compile_full"]


class Benchmark(Strict):
    warmup: NonNegativeInt
    steps: PositiveInt
    rounds: PositiveInt  # evaluate@ speed: the cases take turns this many times
    min_seconds: NonNegativeFloat  # evaluate@ speed: each case's timed seconds at least
    peers: list[Peer]  # PyTorch cases timed beside the compiled step, in the same run


class Package(Strict):
    devices: list[str]
    trial_steps: PositiveInt


class RegressRule(Strict):
    metrics: str  # a glob over "<file>:<dotted key>"
    better: Literal["higher", "lower"]
    rel: NonNegativeFloat | None = None
    abs: NonNegativeFloat | None = None

    @model_validator(mode="after")
    def _one_tolerance(self):
        if (self.rel is None) == (self.abs is None):
            raise ValueError("give exactly one of rel (fraction of the baseline) or abs "
                             "(metric units)")
        return self


class Regress(Strict):
    baseline: str
    rules: list[RegressRule] = Field(min_length=1)


class Params(Strict):
    seed: int
    models: dict[str, Model]
    schemes: dict[str, Scheme]
    optimizers: dict[str, Optimizer]
    cases: dict[str, Case] = Field(min_length=1)
    devices: list[str]
    deploy: list[str]
    profiles: dict[str, dict[str, Any]] = {}
    optimize: Optimize
    benchmark: Benchmark
    package: Package
    regress: Regress

    @model_validator(mode="after")
    def _references(self):
        def named(what: str, names) -> None:
            for name in names:
                if not NAME.match(name):
                    raise ValueError(f"{what} name {name!r}: allowed: letters, digits and _, "
                                     "starting with a letter")

        named("case", self.cases)
        named("model", self.models)
        named("device", self.devices)
        for name, case in self.cases.items():
            for key, table in (("model", self.models), ("scheme", self.schemes),
                               ("optimizer", self.optimizers)):
                if getattr(case, key) not in table:
                    raise ValueError(f"cases.{name}.{key}={getattr(case, key)!r}; allowed: "
                                     f"{sorted(table)}")
            model = self.models[case.model]
            if "finetune" in case.evaluate and (model.finetune is None or model.data is None
                                                or model.data.kind == "tokens"):
                raise ValueError(f"cases.{name}.evaluate has finetune, but model {case.model!r} "
                                 "has no fine-tuning task (finetune: and data with a test split)")
            if "finetune" in case.evaluate and model.task != "classification":
                # fine-tuning scores test accuracy: one class per example
                raise ValueError(f"cases.{name}.evaluate has finetune, but model {case.model!r} "
                                 f"has task {model.task!r}; finetune scores classification "
                                 "models; allowed evaluate for it: ['speed']")
        for name in self.deploy:
            if name not in self.cases:
                raise ValueError(f"deploy names {name!r}; allowed: {sorted(self.cases)}")
        if HOST in self.devices:
            raise ValueError(f"devices lists {HOST!r}: every case is built for the host already; "
                             "devices are the others the deploy cases are built for")
        for device in self.package.devices:
            if device != HOST and device not in self.devices:
                raise ValueError(f"package.devices has {device!r}, which is not built; allowed: "
                                 f"{[HOST, *self.devices]}")
        return self


def case_optimizer(params: Params, case: Case):
    """The case's optimizer, at its own learning rate if it sets one."""
    optimizer = params.optimizers[case.optimizer]
    return optimizer.model_copy(update={"lr": case.lr}) if case.lr else optimizer


def case_optimize(params: Params, case: Case) -> Optimize:
    """The global `optimize` settings with the case's own on top."""
    if case.optimize is None:
        return params.optimize
    own = {k: v for k, v in case.optimize.model_dump().items() if v is not None}
    return params.optimize.model_copy(update=own)


# The conf/ file a key of params.yaml comes from, for error messages.
_ORIGINS = {"models": "conf/model/{}.yaml", "schemes": "conf/sparse/{}.yaml",
            "optimizers": "conf/optimizer/{}.yaml"}


_TAGS = ("sgd", "adam", "adamw", "digits", "sentences", "tokens")


def _explain(error: ValidationError, source: Path) -> ConfigError:
    lines = []
    for item in error.errors():
        # A tagged union (an optimizer's `kind`, a model's `data.kind`) adds its tag to the
        # location after the key that holds it: drop it, keep the user's own names.
        loc, parts = [], list(item["loc"])
        for i, part in enumerate(parts):
            held_by = parts[:i]
            if (len(held_by) == 2 and held_by[0] == "optimizers") or held_by[-1:] == ["data"]:
                if isinstance(part, str) and part in _TAGS:
                    continue
            loc.append(str(part))
        key = ".".join(loc) or "(top level)"
        origin = (_ORIGINS[loc[0]].format(loc[1]) if loc and loc[0] in _ORIGINS and len(loc) > 1
                  else "conf/experiment" if loc and loc[0] in ("cases", "deploy", "devices")
                  else "conf/config.yaml")
        message = item["msg"].removeprefix("Value error, ")
        value = item.get("input")
        shown = f"={value!r}" if not isinstance(value, dict) and item["type"] != "missing" else ""
        lines.append(f"{source.name}: {key}{shown} (from {origin}): {message}")
    return ConfigError("\n".join(lines))


def validate(data: dict, source: Path = PARAMS) -> Params:
    try:
        return Params.model_validate(data)
    except ValidationError as error:
        raise _explain(error, Path(source)) from None


def load_params(path: Path = PARAMS) -> Params:
    """params.yaml, checked against the schema."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: not found; run `pock compose` to write it from conf/")
    return validate(yaml.safe_load(path.read_text()) or {}, path)


def run_stage(main) -> None:
    """Run a stage's main: bad input ends in one message naming file and key, exit code 2;
    what was there before stays (outputs are replaced only when a stage succeeds)."""
    import sys

    try:
        main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
