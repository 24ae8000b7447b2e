"""Device profiles: device_profiles/<name>.yaml, following ``extends`` (a board derived from
another), with params.yaml's ``profiles.<name>`` (Hydra overrides) merged on top; checked
against ``Profile``, so a bad key or value is named with its file and allowed values. The
runner's section (``remote``, ``emulation``, ``docker``) is the runner's own model
(pipelines/runtime/runners).

The resolve stage resolves each profile the pipeline builds for once
(artifacts/resolved/profiles/<name>.json); the stages after it read that
(``resolved_profile``).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import (Field, PositiveFloat, PositiveInt, ValidationError, create_model,
                      field_validator, model_validator)

from pipelines.io import ROOT, read_json
from pipelines.layout import resolved_profile_path
from pipelines.runtime.runners import RUNNERS
from pipelines.schema import ConfigError, Strict

PROFILES = ROOT / "device_profiles"


class Toolchain(Strict):
    """How the library is linked: ``shared``, a .so linked here with ``cc`` (null: TVM's
    default host compiler), or ``archive``, a .tar of objects the device links itself."""

    cc: str | None = None
    package: str | None = None  # the Debian package that provides cc (`pock setup`)
    output: Literal["shared", "archive"] = "shared"


class Tune(Strict):
    """The tune stage: MetaSchedule trials run here per build (0: only the committed records
    of device_profiles/tuned/<name>/), and their search's seed."""

    trials: Annotated[int, Field(ge=0, strict=True)] = 0
    seed: Annotated[int, Field(ge=0, strict=True)] = 0


class ProfileBase(Strict):
    name: str
    description: str = ""
    target: dict[str, Any]  # a TVM target dict: {kind: llvm, mtriple: ..., mcpu: ...}
    host: dict[str, Any] | None = None  # a GPU target's CPU side
    cores: PositiveInt
    memory_mb: PositiveFloat
    memory_budget_mb: PositiveFloat | None = None  # what the step may plan for (default: all)
    runner: Literal[tuple(RUNNERS)]
    toolchain: Toolchain = Toolchain()
    tune: Tune = Tune()
    # a CUDA target: the step's kernels that read only its resident state replayed as CUDA
    # graphs (backend/build.py resident_state), one launch instead of hundreds
    cuda_graph: bool = False
    # a CUDA target: its float32 matrix products on NVIDIA's cuBLAS (backend/cublas_sgemm.cc,
    # which opens libcublas.so.13 where the step runs); null: generated kernels
    gemm_library: Literal["cublas"] | None = None

    @field_validator("target", "host")
    @classmethod
    def _target_dict(cls, value):
        if value is not None and "kind" not in value:
            raise ValueError("a TVM target dict with a 'kind', e.g. {kind: llvm, mtriple: "
                             "aarch64-linux-gnu, mcpu: cortex-a72}")
        return value

    @model_validator(mode="after")
    def _known_to_llvm(self):
        for key in ("target", "host"):
            cpu = getattr(self, key)
            if cpu and cpu["kind"] == "llvm":
                _check_llvm_cpu(cpu, key)
        return self

    @model_validator(mode="after")
    def _runner_needs(self):
        runner = RUNNERS[self.runner]
        section = runner.SECTION
        if section and getattr(self, section) is None and any(
                f.is_required() for f in runner.Config.model_fields.values()):
            raise ValueError(f"runner {self.runner!r} needs the section {section!r} with "
                             f"{sorted(runner.Config.model_fields)}")
        if self.toolchain.output == "archive" and not runner.TAKES_ARCHIVE:
            raise ValueError(f"runner {self.runner!r} needs a library linked here, but "
                             "toolchain.output='archive'; allowed with an archive: "
                             "['none', 'rpc'] (the device links it)")
        if self.tune.trials and not self.runs_here:
            raise ValueError(f"tune.trials={self.tune.trials} needs candidates timed on the "
                             f"device, but runner={self.runner!r}, target kind "
                             f"{self.target['kind']!r}; allowed: tune.trials 0 (committed "
                             "records only), or runner 'local' or 'docker' with an llvm target")
        if self.cuda_graph and self.target["kind"] != "cuda":
            raise ValueError(f"cuda_graph=true needs a CUDA target, but target.kind="
                             f"{self.target['kind']!r}; allowed: cuda_graph false, or target "
                             "kind 'cuda'")
        if self.gemm_library and self.target["kind"] != "cuda":
            raise ValueError(f"gemm_library={self.gemm_library!r} needs a CUDA target, but "
                             f"target.kind={self.target['kind']!r}; allowed: gemm_library "
                             "null, or target kind 'cuda'")
        if hasattr(runner, "check"):
            runner.check(self)
        return self

    @property
    def cpu_architecture(self) -> str:
        """The device CPU's architecture: target.mtriple's, or host.mtriple's for a GPU."""
        return str((self.host or self.target).get("mtriple", "")).split("-")[0]

    @property
    def runs_here(self) -> bool:
        """Whether the device's CPU code runs on this machine's CPU, so that kernels can be
        timed here for it (runner local or docker, an llvm target)."""
        return RUNNERS[self.runner].RUNS_HERE and self.target["kind"] == "llvm"

    @property
    def budget_bytes(self) -> float:
        """Bytes the training step may plan for: memory_budget_mb, else all of memory_mb."""
        return (self.memory_budget_mb or self.memory_mb) * 2**20

    @property
    def source(self) -> str:
        return f"{PROFILES.name}/{self.name}.yaml"


def _check_llvm_cpu(target: dict, key: str) -> None:
    """``mcpu`` and ``mattr`` of an llvm target are what LLVM knows for its ``mtriple``: a
    misspelt CPU would build generic code under the CPU's name."""
    import difflib

    import tvm
    from tvm.target import codegen

    triple = target.get("mtriple") or codegen.llvm_get_system_triple()
    base = tvm.target.Target({"kind": "llvm", "mtriple": triple})
    cpus = sorted(codegen.llvm_get_cpu_archlist(base))
    cpu = target.get("mcpu")
    if cpu and not codegen.llvm_is_valid_cpu(cpu, triple):
        near = difflib.get_close_matches(cpu, cpus, n=5) or cpus[:10]
        raise ValueError(f"{key}.mcpu={cpu!r} is not a CPU LLVM knows for {triple}; allowed, "
                         f"e.g.: {near}")
    features = {f for c in cpus for f in codegen.llvm_get_cpu_features(
        tvm.target.Target({"kind": "llvm", "mtriple": triple, "mcpu": c}))}
    for attr in target.get("mattr") or []:
        if attr[:1] not in "+-" or attr[1:] not in features:
            near = [f"+{f}" for f in difflib.get_close_matches(attr.lstrip("+-"), features)]
            raise ValueError(f"{key}.mattr has {attr!r}, not a feature LLVM knows for "
                             f"{triple}; allowed: +<feature> or -<feature>, e.g. {near}")


# Each runner's settings under its section's key (None where the profile has none).
Profile = create_model("Profile", __base__=ProfileBase, **{
    runner.SECTION: (runner.Config | None, None)
    for runner in RUNNERS.values() if runner.SECTION})


def available_profiles(overrides: dict | None = None) -> list[str]:
    """Profile files, plus boards derived in params.yaml's ``profiles`` with ``extends``."""
    derived = [n for n, o in (overrides or {}).items() if isinstance(o, dict) and "extends" in o]
    return sorted({p.stem for p in PROFILES.glob("*.yaml")} | set(derived))


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``; nested dicts merge, anything else is replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def _profile_layers(name: str, overrides: dict, chain: tuple) -> tuple[dict, str, dict]:
    """The profile ``name`` with ``extends`` followed, before validation; where it came from
    (for errors); and where each top-level key's value came from (``origins``)."""
    if name in chain:
        raise ConfigError(f"{PROFILES}: profiles extend each other in a cycle: "
                          f"{' -> '.join(chain + (name,))}")
    path, override = PROFILES / f"{name}.yaml", overrides.get(name) or {}
    if not isinstance(override, dict):
        raise ConfigError(f"params.yaml: profiles.{name} must be a mapping of profile keys")
    if not path.exists() and "extends" not in override:
        raise ConfigError(f"devices: {name!r} has no profile; allowed: "
                          f"{available_profiles(overrides)} (files in {PROFILES}/, or a board "
                          f"derived with +profiles.{name}.extends=<profile>)")
    own = {}
    if path.exists():
        try:
            own = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
    origins = {key: f"{PROFILES.name}/{name}.yaml" for key in own}
    origins |= {key: f"params.yaml profiles.{name}" for key in override}
    own = _merge(own, override)
    source = f"{path}" + (f" with profiles.{name} from params.yaml" if override else "")
    parent = own.pop("extends", None)
    origins.pop("extends", None)
    if parent is None:
        return {**own, "name": name}, source, origins
    base, _, inherited = _profile_layers(parent, overrides, chain + (name,))
    profile = _merge(base, own)
    origins = {key: f"{where} (inherited from {parent})" for key, where in inherited.items()
               if key != "name"} | {
        key: where + (f", merged over {parent}'s" if isinstance(base.get(key), dict) else "")
        for key, where in origins.items()}
    for key, value, why in _derived(name, parent, base, own):
        profile[key], origins[key] = value, why
    return {**profile, "name": name}, source, origins


def _derived(name: str, parent: str, base: dict, own: dict):
    """What a board derived from ``parent`` does not inherit unless it says so: the
    description and RPC key are its own, and its memory budget keeps the parent's share of
    the board's own memory. (key, value, why) for each."""
    if "description" not in own:
        yield ("description", f"{name}, derived from {parent}: {base.get('description', '')}",
               f"derived: {parent}'s, named {name}")
    remote = own.get("remote") or {}
    if base.get("remote") and "key" not in remote:
        yield ("remote", {**base["remote"], **remote, "key": name},
               f"derived: {parent}'s remote, key {name!r}")
    if "memory_mb" in own and "memory_budget_mb" not in own and base.get("memory_budget_mb"):
        share = base["memory_budget_mb"] / base["memory_mb"]
        yield ("memory_budget_mb", own["memory_mb"] * share,
               f"derived: {parent}'s share of memory ({share:g}) of memory_mb")


def load_profile(name: str, overrides: dict | None = None) -> Profile:
    """The device profile ``name``: device_profiles/<name>.yaml, following ``extends`` (a board
    derived from another), with ``overrides`` (params.yaml's ``profiles``: Hydra overrides)
    merged on top; checked, so a bad key or value is named with its allowed values."""
    profile, source, _ = _profile_layers(name, overrides or {}, ())
    try:
        return Profile.model_validate(profile)
    except ValidationError as error:
        raise ConfigError("\n".join(
            f"{source}: " + (".".join(str(p) for p in item["loc"])
                             + (f"={item['input']!r}" if not isinstance(item.get("input"), dict)
                                and item["type"] != "missing" else "") + ": "
                             if item["loc"] else "")
            + item["msg"].removeprefix("Value error, ") for item in error.errors())) from None


def profile_origins(name: str, overrides: dict | None = None) -> dict[str, str]:
    """Where each top-level key of the profile ``name`` came from: its file, params.yaml's
    overrides, the profile it extends, or derived from those (`pock device show`)."""
    return _profile_layers(name, overrides or {}, ())[2]


def resolved_profile(name: str) -> Profile:
    """The profile the resolve stage resolved for ``name``."""
    path = resolved_profile_path(name)
    if not path.exists():
        raise ConfigError(f"{path}: not found; is {name!r} in devices? Run `dvc repro resolve`")
    return Profile.model_validate(read_json(path))


def variant_for(plan: dict, profile: Profile) -> str:
    """Which of the optimize phase's variants the device builds: "step" where the plan fits
    its budget, "recompute" (cheap activations recomputed) where only that one does. Over
    budget either way: a ConfigError naming the overshoot and the knobs."""
    key = "memory_budget_mb" if profile.memory_budget_mb else "memory_mb"
    budget, peak = profile.budget_bytes, plan["planned_peak_bytes"]
    if peak <= budget:
        return "step"
    twin = plan.get("recompute")
    if twin and twin["planned_peak_bytes"] <= budget:
        return "recompute"
    tried = (f"; recomputing cheap activations brings it to "
             f"{twin['planned_peak_bytes'] / 2**20:.2f} MiB, still over" if twin else
             "" if plan.get("recomputed") else
             "; optimize.recompute=auto would try recomputing cheap activations")
    raise ConfigError(
        f"{profile.source}: the training step's planned peak is {peak / 2**20:.2f} MiB, over "
        f"{key}={getattr(profile, key):g} by {(peak - budget) / 2**20:.2f} MiB{tried} (the "
        "optimize stage's plan.json has the breakdown). Shrink the step: a smaller batch_size "
        "or a sparser scheme (cases.<case>.scheme=bias_only or last_k); or raise "
        f"{key} if the device has the memory")


def tvm_target(profile: Profile):
    import tvm

    target = dict(profile.target)
    if profile.host:
        target["host"] = dict(profile.host)
    return tvm.target.Target(target)
