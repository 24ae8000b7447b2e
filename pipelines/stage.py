"""How a stage's main runs (stages/<name>.py): bad input ends in one message naming the file and
key, and exit code 2; what was there before stays, since outputs are replaced only when a stage
succeeds (pipelines/io.py: atomic_dir)."""
from __future__ import annotations

import sys

from pipelines.schema import ConfigError

EXIT_INPUT = 2


def run_stage(main, *args) -> None:
    try:
        main(*args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
