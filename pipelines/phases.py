"""What each phase of the chain hands the next (pipelines/compile.py), as a type with
``save(directory)`` and ``load(directory)``. A stage is load -> phase -> save; ``compile()`` and
the tests chain the same phases in memory. The file names of every phase live here, and
nowhere else.

    Lowered        lower@<model>      main(*inputs, *params, *buffers), its tables, layers.json
    TrainingStep   autodiff@<case>    the full step (every parameter updated), initial values
    PrunedStep     prune@<case>       the scheme's step, the rules applied, what it removed
    OptimizedStep  optimize@<case>    the optimized step, its plan; the recomputing twin where
                                      a device's memory budget needs it
    Tuning         tune@<case>-<device>    the variant the device builds, its kernels' tuned
                                           schedules (a MetaSchedule database)
    Build          build@<case>-<device>   the step library for one device, its signature, plan
    Reference      reference@<case>       the host build's outputs on the seeded batch, what each
                                           device's build of the case is checked against

A step module carries its signature (pipelines/ir.py) in memory; on disk it is
``signature.json`` beside the TVMScript.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
import yaml

from pipelines.io import (load_arrays, read_json, save_arrays, verified, write_json_atomic,
                          write_text_atomic)
from pipelines.ir import load_ir, save_ir, signature_of
from pipelines.layout import SIGNATURE

STEP = "train_step"            # the step's IR: train_step.json, train_step.relax.py
RECOMPUTE = "train_step_recompute"  # the optimize phase's recomputing twin
INITIAL = "initial.npz"        # every parameter's and buffer's initial value, by Relax name
LAYERS = "layers.json"         # what a scheme selects from (frontends/layers.py)
PLAN = "plan.json"             # the static memory plan (analysis/memory_plan.py)


def _names(table: dict) -> dict[str, tuple[str, str]]:
    return {k: tuple(v) for k, v in table.items()}


@dataclass
class Lowered:
    """Phase 1: a model as ``main(*inputs, *params, *buffers) -> (logits, *new_buffers)``."""

    main: "tvm.relax.Function"
    names: dict[str, tuple[str, str]]  # Relax name -> ("parameter" | "buffer", source name)
    origins: dict[str, str]  # binding -> the source layer it came from (for error messages)
    values: dict[str, np.ndarray]  # each parameter's and buffer's initial value
    layers: dict  # what schemes select from

    MODEL, PARAMS, NAMES, ORIGINS = "model", "params.npz", "names.json", "origins.json"

    @property
    def state(self) -> list[str]:
        """The parameters' and buffers' Relax names, in ``main``'s order."""
        return [v.name for v in self.main.params[int(self.main.attrs["num_input"]):]]

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        save_ir(tvm.IRModule({"main": self.main}), directory, self.MODEL)
        save_arrays(directory / self.PARAMS, {n: self.values[n] for n in self.state})
        write_json_atomic(directory / self.NAMES, {n: list(self.names[n]) for n in self.state})
        write_json_atomic(directory / self.ORIGINS, self.origins)
        write_json_atomic(directory / LAYERS, self.layers)

    @classmethod
    def load(cls, directory: Path) -> Lowered:
        directory = Path(directory)
        return cls(load_ir(directory / f"{cls.MODEL}.json")["main"],
                   _names(read_json(directory / cls.NAMES)), read_json(directory / cls.ORIGINS),
                   load_arrays(directory / cls.PARAMS), read_json(directory / LAYERS))


@dataclass
class TrainingStep:
    """Phase 2: the full training step (every parameter updated; LoRA adapters added), with
    the initial value of everything it holds and the layers its schemes select from."""

    module: tvm.IRModule  # train_step, carrying its signature
    initial: dict[str, np.ndarray]
    layers: dict

    @property
    def signature(self) -> dict:
        return signature_of(self.module)

    def save(self, directory: Path) -> None:
        save_ir(self.module, directory, STEP)
        save_arrays(Path(directory) / INITIAL, self.initial)
        write_json_atomic(Path(directory) / LAYERS, self.layers)

    @classmethod
    def load(cls, directory: Path) -> TrainingStep:
        directory = Path(directory)
        return cls(load_ir(directory / f"{STEP}.json"), cls.load_initial(directory),
                   read_json(directory / LAYERS))

    @staticmethod
    def load_initial(directory: Path) -> dict[str, np.ndarray]:
        """Only the initial values: what running a build of the step needs."""
        return load_arrays(Path(directory) / INITIAL)


@dataclass
class PrunedStep:
    """Phase 3: the step restricted to a scheme: only its parameters (and channels) updated."""

    module: tvm.IRModule
    rules: list[dict]  # the rules applied (for a search: the ones it found)
    report: dict  # what the scheme removes from full BP (analysis/cost.py), a search's table

    RULES = "scheme.yaml"

    def save(self, directory: Path) -> None:
        save_ir(self.module, directory, STEP)
        write_text_atomic(Path(directory) / self.RULES,
                          yaml.safe_dump({"rules": self.rules}, sort_keys=False))

    @classmethod
    def load(cls, directory: Path, report: dict | None = None) -> PrunedStep:
        """The pruned step; ``report`` (the prune stage's metrics file) where it is wanted."""
        directory = Path(directory)
        return cls(load_ir(directory / f"{STEP}.json"), cls.load_rules(directory), report or {})

    @classmethod
    def load_rules(cls, directory: Path) -> list[dict]:
        return yaml.safe_load(verified(Path(directory) / cls.RULES).read_text())["rules"]


@dataclass
class OptimizedStep:
    """Phase 4: the optimized, fused step and its static memory plan. ``recompute`` is the
    twin that recomputes cheap activations, made only where a device's memory budget needs it
    (optimize.recompute auto); a device takes the variant that fits its budget
    (profiles.variant_for)."""

    module: tvm.IRModule
    plan: dict
    recompute: tvm.IRModule | None = None

    def save(self, directory: Path) -> None:
        save_ir(self.module, directory, STEP)
        if self.recompute is not None:
            save_ir(self.recompute, directory, RECOMPUTE)
        write_json_atomic(Path(directory) / PLAN, self.plan)

    @classmethod
    def load(cls, directory: Path) -> OptimizedStep:
        directory = Path(directory)
        twin = directory / f"{RECOMPUTE}.json"
        return cls(load_ir(directory / f"{STEP}.json"), read_json(directory / PLAN),
                   load_ir(twin) if twin.exists() else None)

    def variant(self, name: str) -> tuple[tvm.IRModule, dict]:
        """The step and plan of a variant (profiles.variant_for): "step" or "recompute"."""
        if name == "recompute":
            return self.recompute, self.plan["recompute"]
        return self.module, self.plan

    @staticmethod
    def load_variant(directory: Path, name: str) -> tuple[tvm.IRModule, dict]:
        """One variant from disk, without reading the other."""
        directory = Path(directory)
        plan = read_json(directory / PLAN)
        if name == "recompute":
            return load_ir(directory / f"{RECOMPUTE}.json"), plan["recompute"]
        return load_ir(directory / f"{STEP}.json"), plan

    @staticmethod
    def load_plan(directory: Path) -> dict:
        return read_json(Path(directory) / PLAN)


@dataclass
class Tuning:
    """For one device: which variant of the optimized step it builds (profiles.variant_for),
    and a tuning database with the schedules of that step's kernels (backend/tune_step.py)."""

    directory: Path  # the database's (backend/databases.py: open_database)
    variant: str
    metrics: dict

    METRICS = "metrics.json"

    def save(self) -> None:
        write_json_atomic(self.directory / self.METRICS, {**self.metrics, "variant": self.variant})

    @classmethod
    def load(cls, directory: Path) -> Tuning:
        metrics = read_json(Path(directory) / cls.METRICS)
        return cls(Path(directory), metrics.pop("variant"), metrics)


@dataclass
class Build:
    """Phase 6: the step compiled and linked for one device: ``library`` in ``directory``,
    with its signature, its plan and what the build did (backend/build.py: target, toolchain,
    schedules, backends)."""

    directory: Path
    signature: dict
    plan: dict
    built: dict = field(default_factory=dict)

    BUILT = "build.json"

    @property
    def library(self) -> Path:
        return self.directory / self.built["library"]

    def save(self) -> None:
        write_json_atomic(self.directory / SIGNATURE, self.signature)
        write_json_atomic(self.directory / PLAN, self.plan)
        write_json_atomic(self.directory / self.BUILT, self.built)

    @classmethod
    def load(cls, directory: Path) -> Build:
        directory = Path(directory)
        return cls(directory, read_json(directory / SIGNATURE), read_json(directory / PLAN),
                   read_json(directory / cls.BUILT))


@dataclass
class Reference:
    """The host build's outputs after one step on the seeded batch (reference@<case>), by output
    name: what each device's build must give on the same arguments (evaluate/device.py)."""

    outputs: dict[str, np.ndarray]

    OUTPUTS = "outputs.npz"

    def save(self, directory: Path) -> None:
        save_arrays(Path(directory) / self.OUTPUTS, self.outputs)

    @classmethod
    def load(cls, directory: Path) -> Reference:
        return cls(load_arrays(Path(directory) / cls.OUTPUTS))

    def ordered(self, signature: dict) -> list[np.ndarray]:
        """The outputs in the step's order (the loss, then each new state tensor)."""
        return [self.outputs[name] for name in signature["outputs"]]
