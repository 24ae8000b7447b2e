"""Nothing here reaches the device (a phone without a tracker, a Mac, a board not yet set up):
the build is made, and the benchmark records why nothing ran and how to reach it."""
from __future__ import annotations

from pathlib import Path

from pipelines.runtime.runners import NotReachable

SECTION = None
TAKES_ARCHIVE = True
RUNS_HERE = False
LABEL = "compiled"


def run(library: Path, args: list, profile, warmup: int, steps: int):
    archive = Path(library).suffix == ".tar"
    raise NotReachable(
        "runner none: nothing here reaches the device"
        + ("; the archive is linked on the device" if archive else "")
        + f"; to run it, start `python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY` "
          f"there and set +profiles.{profile.name}.runner=rpc")
