"""Device profiles: device_profiles/<name>.yaml, following ``extends`` (a board derived from
another), with params.yaml's ``profiles.<name>`` (Hydra overrides) merged on top; checked, so a
bad key or value is named with its allowed values."""
from __future__ import annotations

from pathlib import Path

import yaml

from pipelines.config import PARAMS, ConfigError
from pipelines.io import ROOT

PROFILES = ROOT / "device_profiles"


def require(cfg: dict, dotted: str, source: str | Path = PARAMS):
    """cfg['a']['b'] for 'a.b', or a ConfigError naming the file and the missing key."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{source}: missing key '{dotted}'")
        node = node[part]
    return node


def choose(value, allowed, key: str, source: str | Path = PARAMS):
    if value not in allowed:
        raise ConfigError(f"{source}: {key}={value!r} is not one of {sorted(allowed)}")
    return value


def available_profiles(overrides: dict | None = None) -> list[str]:
    """Profile files, plus boards derived in params.yaml's ``profiles`` with ``extends``."""
    derived = [n for n, o in (overrides or {}).items() if isinstance(o, dict) and "extends" in o]
    return sorted({p.stem for p in PROFILES.glob("*.yaml")} | set(derived))


PROFILE_KEYS = {"name", "description", "extends", "target", "host", "cores", "memory_mb",
                "memory_budget_mb", "runner", "toolchain", "remote", "emulation", "docker", "tune"}
# local: this machine; rpc: a TVM RPC tracker's server; emulated: qemu user mode here; docker:
# this machine's CPU in a container limited to the profile's cores and memory; none: built only
# (nothing here reaches the device, or it links the archive itself).
RUNNERS = {"local", "rpc", "emulated", "docker", "none"}
# shared: a library linked here (.so); archive: object files the device links itself (.tar).
OUTPUTS = {"shared", "archive"}


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``; nested dicts merge, anything else is replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def _profile_layers(name: str, overrides: dict, chain: tuple) -> tuple[dict, str]:
    """The profile ``name`` with ``extends`` followed, before validation; and where it came
    from (for errors)."""
    if name in chain:
        raise ConfigError(f"{PROFILES}: profiles extend each other in a cycle: "
                          f"{' -> '.join(chain + (name,))}")
    path, override = PROFILES / f"{name}.yaml", overrides.get(name) or {}
    if not isinstance(override, dict):
        raise ConfigError(f"{PARAMS}: profiles.{name} must be a mapping of profile keys")
    if not path.exists() and "extends" not in override:
        raise ConfigError(f"devices: {name!r} has no profile; allowed: "
                          f"{available_profiles(overrides)} (files in {PROFILES}/, or a board "
                          f"derived with +profiles.{name}.extends=<profile>)")
    profile = {}
    if path.exists():
        with open(path) as handle:
            profile = yaml.safe_load(handle) or {}
    profile = _merge(profile, override)
    source = f"{path}" + (f" with profiles.{name} from {PARAMS.name}" if override else "")
    if "extends" in profile:
        base, _ = _profile_layers(profile.pop("extends"), overrides, chain + (name,))
        profile = _merge(base, profile)
    profile["name"] = name
    return profile, source


def load_profile(name: str, overrides: dict | None = None) -> dict:
    """The device profile ``name``: device_profiles/<name>.yaml, following ``extends`` (a board
    derived from another), with params.yaml's ``profiles.<name>`` merged on top (Hydra
    overrides land there); checked, so a bad key or value is named with its allowed values."""
    if overrides is None:
        overrides = dict(yaml.safe_load(PARAMS.read_text()).get("profiles") or {}) \
            if PARAMS.exists() else {}
    profile, path = _profile_layers(name, overrides, ())
    unknown = set(profile) - PROFILE_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(PROFILE_KEYS)}")
    for key in ("target", "cores", "memory_mb", "runner"):
        require(profile, key, path)
    for key in ("target", "host"):
        if key == "target" or profile.get("host") is not None:
            if not isinstance(profile[key], dict) or "kind" not in profile[key]:
                raise ConfigError(f"{path}: '{key}' must be a TVM target dict with a 'kind', "
                                  "e.g. {kind: llvm, mtriple: aarch64-linux-gnu, mcpu: cortex-a72}")
    choose(profile["runner"], RUNNERS, "runner", path)
    toolchain = profile["toolchain"] = profile.get("toolchain") or {}
    choose(toolchain.setdefault("output", "shared"), OUTPUTS, "toolchain.output", path)
    for key in ("memory_mb", "memory_budget_mb"):
        value = profile.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"{path}: {key}={value!r}; allowed: a positive number of MiB")
    check_tune(profile, path)
    if profile["runner"] == "rpc":
        for key in ("remote.tracker", "remote.key"):
            require(profile, key, path)
        host, _, port = str(profile["remote"]["tracker"]).rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{path}: remote.tracker={profile['remote']['tracker']!r}; "
                              "allowed: HOST:PORT of a TVM RPC tracker, e.g. 127.0.0.1:9190")
    if profile["runner"] == "emulated":
        for key in ("emulation.qemu", "emulation.root"):
            require(profile, key, path)
    if toolchain["output"] == "archive" and profile["runner"] in ("local", "emulated", "docker"):
        raise ConfigError(f"{path}: runner={profile['runner']!r} needs a library linked here, "
                          "but toolchain.output='archive'; allowed with an archive: "
                          "['none', 'rpc'] (the device links it)")
    if profile["runner"] == "docker":
        import platform

        if profile["target"]["kind"] != "llvm" or cpu_architecture(profile) != platform.machine():
            raise ConfigError(f"{path}: runner='docker' runs the build on this machine's CPU "
                              f"({platform.machine()}), but target is {profile['target']}; "
                              "allowed: an llvm target with mtriple "
                              f"{platform.machine()}-linux-gnu (for another CPU: emulated, rpc "
                              "or none)")
    return profile


def runs_here(profile: dict) -> bool:
    """Whether the device's CPU code runs on this machine's CPU, so that kernels can be timed
    here for it: runner local, or docker (a container on this machine's CPU, which its
    benchmark times too; load_profile holds its target to this machine's architecture)."""
    return profile["runner"] in ("local", "docker") and profile["target"]["kind"] == "llvm"


def check_tune(profile: dict, path) -> None:
    """``tune.trials``: MetaSchedule trials the tune stage runs for this device (default 0:
    only the committed pre-tuned records); ``tune.seed`` seeds their search (default 0). Tuning
    times candidates here (runs_here)."""
    tune = profile["tune"] = {"trials": 0, "seed": 0, **(profile.get("tune") or {})}
    unknown = set(tune) - {"trials", "seed"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted('tune.' + k for k in unknown)}; "
                          "allowed: ['tune.seed', 'tune.trials']")
    for key in ("trials", "seed"):
        value = tune[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{path}: tune.{key}={value!r}; allowed: a whole number >= 0")
    trials = tune["trials"]
    if trials and not runs_here(profile):
        raise ConfigError(f"{path}: tune.trials={trials} needs candidates timed on the device, "
                          f"but runner={profile['runner']!r}, target kind "
                          f"{profile['target']['kind']!r}; allowed: tune.trials 0 (committed "
                          "records only), or runner 'local' or 'docker' with an llvm target")


def cpu_architecture(profile: dict) -> str:
    """The device CPU's architecture: target.mtriple's, or host.mtriple's for a GPU target."""
    cpu = profile["host"] if profile.get("host") else profile["target"]
    return str(cpu.get("mtriple", "")).split("-")[0]


def resolved_profile(name: str) -> dict:
    """The profile the profiles stage resolved for ``name`` (artifacts/profiles/<name>.json)."""
    import json

    from pipelines.layout import profile_path

    path = profile_path(name)
    if not path.exists():
        raise ConfigError(f"{path}: not found; is {name!r} in devices? Run `dvc repro profiles`")
    return json.loads(path.read_text())


def check_memory_budget(plan: dict, profile: dict, where: Path) -> bool:
    """Whether the step must recompute activations to fit the profile's budget
    (memory_budget_mb, else all of memory_mb). ``plan`` is the optimize stage's plan.json: the
    step as optimized, and under ``recompute`` the plan of its recomputing twin (written when
    optimize.recompute is auto). Over budget either way: name the overshoot and the knobs."""
    key = "memory_budget_mb" if profile.get("memory_budget_mb") else "memory_mb"
    budget = float(profile[key]) * 2**20
    peak = plan["planned_peak_bytes"]
    if peak <= budget:
        return False
    twin = plan.get("recompute")
    if twin and twin["planned_peak_bytes"] <= budget:
        return True
    tried = (f"; recomputing cheap activations brings it to "
             f"{twin['planned_peak_bytes'] / 2**20:.2f} MiB, still over" if twin else
             "" if plan.get("recomputed") else
             "; optimize.recompute=auto would try recomputing cheap activations")
    raise ConfigError(
        f"{PROFILES.name}/{profile['name']}.yaml: the training step's planned peak is "
        f"{peak / 2**20:.2f} MiB, over {key}={profile[key]} by {(peak - budget) / 2**20:.2f}"
        f" MiB{tried} ({where} has the breakdown). Shrink the step: a smaller batch_size or a "
        "sparser scheme (cases.<case>.scheme=bias_only or last_k); or "
        f"raise {key} if the device has the memory")


def tvm_target(profile: dict):
    import tvm

    target = dict(profile["target"])
    if profile.get("host"):
        target["host"] = dict(profile["host"])
    return tvm.target.Target(target)
