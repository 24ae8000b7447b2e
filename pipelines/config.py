"""Reading the composed configuration (params.yaml) and device profiles, with clear errors.

Stage code reads params.yaml, never Hydra directly: DVC tracks params.yaml keys per stage.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from pipelines.artifacts import ROOT

PARAMS = ROOT / "params.yaml"
CONF = ROOT / "conf"
PROFILES = ROOT / "device_profiles"


class ConfigError(Exception):
    """Bad user input: the message names the file, the key and what is allowed."""


def load_params(path: Path = PARAMS) -> dict:
    if not Path(path).exists():
        raise ConfigError(f"{path}: not found; run `pock compose` to write it from conf/")
    with open(path) as handle:
        return yaml.safe_load(handle)


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


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


PROFILE_KEYS = {"name", "description", "target", "host", "cores", "memory_mb",
                "memory_budget_mb", "runner", "toolchain", "remote"}
RUNNERS = {"local"}


def load_profile(name: str) -> dict:
    """device_profiles/<name>.yaml, checked: target is a TVM target dict, runner is known."""
    path = PROFILES / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"{PARAMS}: devices contains {name!r}, which has no profile; "
                          f"allowed: {available_profiles()} (files in {PROFILES})")
    with open(path) as handle:
        profile = yaml.safe_load(handle)
    unknown = set(profile) - PROFILE_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(PROFILE_KEYS)}")
    for key in ("target", "cores", "memory_mb", "runner"):
        require(profile, key, path)
    if not isinstance(profile["target"], dict) or "kind" not in profile["target"]:
        raise ConfigError(f"{path}: 'target' must be a TVM target dict with a 'kind', e.g. "
                          "{kind: llvm, mcpu: skylake-avx512}")
    choose(profile["runner"], RUNNERS, "runner", path)
    for key in ("memory_mb", "memory_budget_mb"):
        value = profile.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"{path}: {key}={value!r}; allowed: a positive number of MiB")
    profile.setdefault("name", name)
    return profile


def check_memory_budget(plan: dict, profile: dict) -> bool:
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
        f" MiB{tried} (artifacts/optimize/plan.json has the breakdown). Shrink the step: a "
        "smaller model.batch_size or a sparser scheme (sparse=bias_only or sparse=last_k); or "
        f"raise {key} if the device has the memory")


def tvm_target(profile: dict):
    import tvm

    target = dict(profile["target"])
    if profile.get("host"):
        target["host"] = dict(profile["host"])
    return tvm.target.Target(target)


def run_stage(main) -> None:
    """Run a stage's main: bad input ends in one line naming file and key, exit code 2."""
    import sys

    try:
        main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
