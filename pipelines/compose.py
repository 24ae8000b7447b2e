"""Hydra composition of conf/ into params.yaml, exactly as DVC's Hydra integration writes it
(`dvc exp run -S key=value` and `pock compose key=value` give the same bytes)."""
from __future__ import annotations

from pathlib import Path

from pipelines.artifacts import write_text_atomic
from pipelines.config import CONF, PARAMS, ConfigError, load_profile
from pipelines.images import packageable


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
    profiles = OmegaConf.to_container(cfg.profiles) if "profiles" in cfg else {}
    for device in cfg.devices:  # each resolves: an unknown name or a bad value is named here
        load_profile(device, profiles)
    if "host" not in cfg.devices:
        raise ConfigError(f"{CONF / 'config.yaml'}: devices={list(cfg.devices)} lacks 'host': "
                          "fine-tuning runs its build, and other devices' losses are checked "
                          "against it")
    for device in cfg.package.devices:
        if device not in cfg.devices:
            raise ConfigError(f"{CONF / 'config.yaml'}: package.devices has {device!r}, which "
                              f"is not built; allowed: devices={list(cfg.devices)}")
        packageable(load_profile(device, profiles))
    steps = cfg.package.get("trial_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"{CONF / 'config.yaml'}: package.trial_steps={steps!r}; allowed: an "
                          "integer >= 1 (batches the packaged image fine-tunes on, within the "
                          "device's limits)")
    return OmegaConf.to_yaml(cfg)


def compose(overrides: list[str], output: Path = PARAMS) -> None:
    write_text_atomic(output, compose_text(overrides))


def is_stale(output: Path = PARAMS) -> bool:
    """True when params.yaml differs from conf/ composed with no overrides."""
    return not Path(output).exists() or Path(output).read_text() != compose_text([])
