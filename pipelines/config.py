"""The configuration every stage reads: params.yaml (composed from conf/ by Hydra: `pock compose`
or `dvc exp run -S ...`), checked against the schema below before any artifact moves.

A wrong type, an unknown key or a name that refers to nothing is a ``ConfigError`` naming the key,
the conf/ file it came from and what is allowed. Stages exit 2 on it (pipelines/stage.py).

The sections of the extension points are defined where the extensions are, and collected here
through their registries (pipelines/registry.py): a model's (pipelines/frontends), its data's
(pipelines/data), a peer's name (pipelines/peers). Device profiles have their own schema
(pipelines/profiles.py).

params.yaml holds:
    models      name -> Model        conf/model/<name>.yaml, the ones the experiment uses
    schemes     name -> Scheme       conf/sparse/<name>.yaml, every one
    optimizers  name -> Optimizer    conf/optimizer/<name>.yaml, every one
    cases       name -> Case         conf/experiment/<name>.yaml: what the chain compiles
    deploy, devices                  the cases built for each device besides the host
    profile                          the cases profiled kernel by kernel on the host
    optimize, benchmark, package, regress, profiles, seed   conf/config.yaml
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                      ValidationError, model_validator)

from pipelines.data import KINDS
from pipelines.frontends import FRONTENDS, Model
from pipelines.io import ROOT
from pipelines.peers import PEERS
from pipelines.schema import HOST, NAME, ConfigError, Strict

PARAMS = ROOT / "params.yaml"
CONF = ROOT / "conf"


# A decay or momentum factor: from 0 (none) up to, not including, 1 (never forgets, diverges).
Fraction = Annotated[float, Field(ge=0, lt=1)]
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
    # what the rule selects steps at the case's learning rate times this (its own torch.optim
    # param group): few, small tensors, such as biases, may take a larger step than weights
    lr_scale: PositiveFloat | None = None


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
    """Search a scheme under a memory budget (pipelines/search.py)."""

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
    # Batch norms' running statistics: moved only in the layers whose scale the scheme trains,
    # held (and normalised with, as in PyTorch's eval mode) in the others; or moved in every
    # layer, as PyTorch's train mode does (transform/freeze_statistics.py).
    statistics: Literal["trained_layers", "every_layer"] = "trained_layers"

    @model_validator(mode="after")
    def _rules_or_search(self):
        if bool(self.rules) == bool(self.search):
            raise ValueError("a scheme has rules, or a search that finds them (search:), not "
                             "both and not neither")
        return self


class Stepping(Strict):
    """What every optimizer has: its learning rate, and how many batches' gradients it sums
    before it steps (transformers' gradient_accumulation_steps: a batch of batch_size times
    that, in memory for one; training/optimizers.py: Accumulating)."""

    lr: PositiveFloat
    gradient_accumulation_steps: PositiveInt = 1


class SGD(Stepping):
    """torch.optim.SGD (dampening 0)."""

    kind: Literal["sgd"]
    momentum: Fraction = 0.0
    nesterov: bool = False
    weight_decay: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self):
        if self.nesterov and not self.momentum:
            raise ValueError("nesterov needs momentum > 0")
        return self


class Adam(Stepping):
    """torch.optim.Adam, or AdamW (decoupled weight decay)."""

    kind: Literal["adam", "adamw"]
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


Optimizer = Annotated[Union[SGD, Adam], Field(discriminator="kind")]


FrozenDtype = Literal["float32", "float16", "bfloat16", "int8"]  # transform/store_frozen_weights.py


class OptimizeOverride(Strict):
    reorder_updates: bool | None = None
    update_in_place: bool | None = None
    recompute: Literal["never", "auto", "always"] | None = None
    loss_chunk_rows: NonNegativeInt | None = None
    frozen_dtype: FrozenDtype | None = None


class Case(Strict):
    """One thing the chain compiles: a model, a scheme and an optimizer."""

    model: str
    scheme: str
    optimizer: str
    lr: PositiveFloat | None = None  # instead of the optimizer's
    gradient_accumulation_steps: PositiveInt | None = None  # instead of the optimizer's
    optimize: OptimizeOverride | None = None  # instead of the global `optimize`
    # what evaluate@<case> measures: speed and memory against PyTorch; fine-tuning quality
    evaluate: list[Literal["speed", "finetune"]] = ["speed"]


class Optimize(Strict):
    reorder_updates: bool
    update_in_place: bool
    recompute: Literal["never", "auto", "always"]
    loss_chunk_rows: NonNegativeInt  # a frozen LM head's loss over chunks of rows; 0: whole
    frozen_dtype: FrozenDtype  # the float the step stores the weights it never updates in


Peer = Literal[tuple(PEERS)]  # pipelines/peers


class Benchmark(Strict):
    warmup: NonNegativeInt
    steps: PositiveInt
    rounds: PositiveInt  # evaluate@ speed: the cases take turns this many times
    min_seconds: NonNegativeFloat  # evaluate@ speed: each case's timed seconds at least
    peers: list[Peer]  # timed beside the compiled step, in the same run


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
    profile: list[str]
    profiles: dict[str, dict[str, Any]] = {}
    optimize: Optimize
    benchmark: Benchmark
    package: Package
    regress: Regress

    @model_validator(mode="after")
    def _references(self):
        for what, names in (("cases", self.cases), ("models", self.models),
                            ("devices", self.devices)):
            for name in names:
                if not NAME.match(name):
                    raise Misreference(what, name, "not a name; allowed: letters, digits and "
                                       "_, starting with a letter")
        for name, case in self.cases.items():
            for key, table in (("model", self.models), ("scheme", self.schemes),
                               ("optimizer", self.optimizers)):
                if getattr(case, key) not in table:
                    raise Misreference(f"cases.{name}.{key}", getattr(case, key),
                                       f"no such {key}; allowed: {sorted(table)}")
            model = self.models[case.model]
            if "finetune" in case.evaluate and (model.finetune is None or model.data is None
                                                or not KINDS[model.data.kind].TASKS):
                raise Misreference(f"cases.{name}.evaluate", case.evaluate, f"has finetune, but "
                                   f"model {case.model!r} has no fine-tuning task (finetune: "
                                   "and data with a test split)")
            tasks = KINDS[model.data.kind].TASKS if model.data else ()
            if "finetune" in case.evaluate and model.task not in tasks:
                raise Misreference(f"cases.{name}.evaluate", case.evaluate, f"has finetune, but "
                                   f"model {case.model!r} has task {model.task!r} and its data "
                                   f"(kind {model.data.kind!r}) labels for {list(tasks)}")
        for key in ("deploy", "profile"):
            for name in getattr(self, key):
                if name not in self.cases:
                    raise Misreference(key, name, f"no such case; allowed: {sorted(self.cases)}")
        if HOST in self.devices:
            raise Misreference("devices", HOST, "every case is built for the host already; "
                               "devices are the others the deploy cases are built for")
        for device in self.package.devices:
            if device != HOST and device not in self.devices:
                raise Misreference("package.devices", device, "not built (not in devices); "
                                   f"allowed: {[HOST, *self.devices]} (override "
                                   "package.devices with devices)")
        return self


class Misreference(ValueError):
    """A value naming what params.yaml does not hold: raised where the whole file is checked,
    so it carries its own key (pydantic locates it at the top level)."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key}={value!r}: {reason}")
        self.key, self.value, self.reason = key, value, reason


def case_optimizer(params: Params, case: Case):
    """The case's optimizer, at its own learning rate and accumulation if it sets them."""
    own = {k: getattr(case, k) for k in ("lr", "gradient_accumulation_steps") if getattr(case, k)}
    return params.optimizers[case.optimizer].model_copy(update=own)


def case_optimize(params: Params, case: Case) -> Optimize:
    """The global `optimize` settings with the case's own on top."""
    if case.optimize is None:
        return params.optimize
    own = {k: v for k, v in case.optimize.model_dump().items() if v is not None}
    return params.optimize.model_copy(update=own)


# The conf/ file a key of params.yaml comes from, for error messages.
_ORIGINS = {"models": "conf/model/{}.yaml", "schemes": "conf/sparse/{}.yaml",
            "optimizers": "conf/optimizer/{}.yaml"}
# A tagged union adds its tag to an error's location after the key that holds it (an
# optimizer's kind, a model's frontend, a data section's kind): dropped, so that errors name
# the user's own keys.
_TAGS = {"optimizer": {"sgd", "adam", "adamw"}, "model": set(FRONTENDS), "data": set(KINDS)}


def _union_tag(held_by: list, part) -> bool:
    if len(held_by) == 2 and held_by[0] in ("optimizers", "models"):
        return part in _TAGS[held_by[0].removesuffix("s")]
    return held_by[-1:] == ["data"] and part in _TAGS["data"]


def _explain(error: ValidationError, source: Path) -> ConfigError:
    lines = []
    for item in error.errors():
        cause = item.get("ctx", {}).get("error")
        parts = cause.key.split(".") if isinstance(cause, Misreference) else list(item["loc"])
        loc = [str(part) for i, part in enumerate(parts) if not _union_tag(parts[:i], part)]
        key = ".".join(loc) or "(top level)"
        own = (_ORIGINS[loc[0]].format(loc[1]) if loc and loc[0] in _ORIGINS and len(loc) > 1
               else None)
        origin = (own if own and (ROOT / own).is_file()
                  else "conf/experiment"  # a model or scheme the experiment defines
                  if own or loc and loc[0] in ("cases", "deploy", "profile", "devices")
                  else "conf/config.yaml")
        message = item["msg"].removeprefix("Value error, ")
        value = item.get("input")
        if isinstance(cause, Misreference):
            message, value = cause.reason, cause.value
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
