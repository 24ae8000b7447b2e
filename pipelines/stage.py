"""How a stage's main runs (stages/<name>.py): bad input, or an artifact that is not what its
stage wrote, ends in one message naming the file (and key), and exit code 2; a training step
whose loss or state is not finite, in one naming the step and the tensor, and exit code 3; what was there before stays, since outputs are replaced only when a stage
succeeds (pipelines/io.py: atomic_dir).

With ``POCK_READS`` set to a file, each artifact the stage's process opens for reading is
appended to it (with the stage's command), so that a test can hold every read to the stage's
declared DVC deps (tests/test_pipeline_e2e.py).

A compile phase's stage (``phase``) also writes how long its process ran, start to outputs
written, to artifacts/metrics/time/<phase>/<its arguments>.json: the report adds them up to
the time a case takes from its model to its first step (docs/architecture.md).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipelines.io import ARTIFACTS, CorruptArtifact, write_json_atomic
from pipelines.layout import phase_time_path
from pipelines.runtime.checks import BadBatch, StepError
from pipelines.schema import ConfigError
from pipelines.timing import process_seconds

EXIT_INPUT, EXIT_STEP = 2, 3


def _record_reads(log: Path) -> None:
    command = " ".join(["python -m", f"stages.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
    root, seen = str(ARTIFACTS), set()

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, os.PathLike)):
            return
        path, mode = os.path.abspath(os.fspath(args[0])), args[1]
        reading = "r" in mode if isinstance(mode, str) else not (args[2] & os.O_ACCMODE)
        if (reading and path.startswith(root + os.sep) and path not in seen
                and not os.path.isdir(path)):  # a directory opened to list or remove it
            seen.add(path)
            with open(log, "a") as handle:  # our own write: not a read
                handle.write(json.dumps({"cmd": command, "path": path}) + "\n")

    sys.addaudithook(hook)


def run_stage(main, *args, phase: str | None = None, model: str | None = None) -> None:
    """``main(*args)``, exiting as the module says; a stage of one ``model`` names it where
    the library's messages say ``models.<name>``."""
    if os.environ.get("POCK_READS"):
        _record_reads(Path(os.environ["POCK_READS"]))
    try:
        main(*args)
        if phase is not None:  # only a stage that succeeded: a failed one's time means nothing
            write_json_atomic(phase_time_path(phase, "-".join(args)),
                              {"seconds": round(process_seconds(), 2)})
    except (ConfigError, CorruptArtifact, BadBatch) as err:
        message = str(err)
        if model is not None:
            message = message.replace("models.<name>", f"models.{model}")
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except StepError as err:  # a step that went NaN: the state before it is kept
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_STEP)
