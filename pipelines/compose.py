"""Hydra composition of conf/ into params.yaml, exactly as DVC's Hydra integration writes it
(`dvc exp run -S key=value` and `pock compose key=value` give the same bytes)."""
from __future__ import annotations

from pathlib import Path

from pipelines.artifacts import write_text_atomic
from pipelines.config import CONF, PARAMS, ConfigError, available_profiles


def compose_text(overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
    except HydraException as err:  # Hydra's message names the group and its options
        raise ConfigError(f"{CONF}: {err}") from err
    OmegaConf.resolve(cfg)
    missing = [d for d in cfg.devices if d not in available_profiles()]
    if missing:
        raise ConfigError(f"{CONF / 'config.yaml'}: devices={list(cfg.devices)} names "
                          f"{missing}, which have no profile; allowed: {available_profiles()}")
    return OmegaConf.to_yaml(cfg)


def compose(overrides: list[str], output: Path = PARAMS) -> None:
    write_text_atomic(output, compose_text(overrides))


def is_stale(output: Path = PARAMS) -> bool:
    """True when params.yaml differs from conf/ composed with no overrides."""
    return not Path(output).exists() or Path(output).read_text() != compose_text([])
