"""What every configuration model builds on, and the one error bad input raises.

The whole schema (pipelines/config.py) is assembled from sections defined where they are used:
each frontend, data kind, runner and peer declares its own model (a ``Strict`` subclass), and
the registries collect them. This module sits below all of them.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

HOST = "host"  # the machine pockengine runs on: every case is built and evaluated for it
# Case, model and device names become DVC stage names (`build@<case>`, `tune@<case>-<device>`)
# and paths: no dots (params keys), dashes (matrix names) or slashes.
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class ConfigError(Exception):
    """Bad user input: the message names the file, the key and what is allowed. Commands and
    stages exit 2 on it (pipelines/stage.py, pipelines/cli.py)."""


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
