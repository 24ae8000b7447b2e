"""Hydra composition of conf/ into params.yaml, exactly as DVC's Hydra integration writes it
(`dvc exp run -S key=value` and `pock compose key=value` give the same bytes); checked against
the schema (pipelines/config.py) and every device profile resolved, before anything is written.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from pipelines.config import CONF, HOST, PARAMS, ConfigError, validate
from pipelines.io import write_text_atomic
from pipelines.profiles import load_profile
from pipelines.runtime.images import packageable


def compose_text(overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as err:  # names the group and options
        _misspelt(overrides, err)
        raise ConfigError(f"{CONF}: {err}") from err
    except yaml.YAMLError:  # Hydra's reader does not say which file
        raise _unreadable() from None
    text = OmegaConf.to_yaml(cfg)
    params = validate(yaml.safe_load(text), PARAMS)
    # each resolves, and so does every board params.yaml changes or derives: a bad name or
    # value is named here
    for device in dict.fromkeys([HOST, *params.devices, *params.profiles]):
        profile = load_profile(device, params.profiles)
        if device in params.package.devices:
            packageable(profile)
    return text


def _misspelt(overrides: list[str], err: Exception) -> None:
    """Where Hydra refused to override a key conf/ lacks (its advice: append it with ``+``),
    the schema's error for the key appended, which lists the keys allowed there; nothing
    where the key appended is valid (Hydra's advice was right)."""
    refused = re.match(r"Could not override '([^']+)'", str(err))
    if refused is None or "To append to your config use +" not in str(err):
        return
    key = refused.group(1)
    appended = [f"+{o}" if o.split("=", 1)[0] == key else o for o in overrides]
    try:
        compose_text(appended)
    except ConfigError as schema:
        raise ConfigError(f"{key}: conf/ has no such key\n{schema}") from None


def _unreadable() -> ConfigError:
    """The conf/ files that are not YAML, each with where and why."""
    problems = []
    for path in sorted(CONF.rglob("*.yaml")):
        try:
            yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problems.append(f"{path.relative_to(CONF.parent)}{where}: not valid YAML "
                            f"({getattr(err, 'problem', None) or err})")
    return ConfigError("\n".join(problems) or f"{CONF}: a file is not valid YAML")


def compose(overrides: list[str], output: Path = PARAMS) -> None:
    write_text_atomic(output, compose_text(overrides))


def is_stale(output: Path = PARAMS) -> bool:
    """True when params.yaml differs from conf/ composed with no overrides."""
    return not Path(output).exists() or Path(output).read_text() != compose_text([])
