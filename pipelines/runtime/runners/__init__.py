"""Runners: how a device's build is reached and run (a device profile's ``runner``), for
benchmark@<case>-<device> (pipelines/evaluate/device.py).

A runner is a module here, registered in RUNNERS (pipelines/registry.py) under its module name,
with
    SECTION    the profile key holding its settings (remote, emulation, docker), or None; its
    Config     model, part of the profile's schema (pipelines/profiles.py)
    RUNS_HERE  whether the device's code runs on this machine's CPU, so that kernels can be
               timed here for it (the build's backend choice, tuning)
    TAKES_ARCHIVE  whether it runs a build the device links itself (toolchain.output archive:
               TVM's RPC server links an uploaded .tar), or needs a library linked here
    LABEL      what its step times are: "compiled" (the device's own), "emulated" (qemu's) or
               "container" (this machine's cores in a container), kept apart in the metrics
    run(library, args, profile, warmup, steps) -> (outputs, step times in ms, info)
               one step on ``args``, whose outputs the caller checks against the host build,
               then ``steps`` timed steps after ``warmup``; raises NotReachable where nothing
               here reaches the device, images.OutOfMemory where the step does not fit
    check(profile)   what the runner needs of the rest of the profile (a ValueError saying
               what is allowed)
    requirements(profile) -> {tool: Debian package}   what `pock setup` installs for it
    prepare(profile) -> str | None   what `pock setup` makes for it once they are installed
               (an emulation root, a running Docker engine), said in a line
"""
from __future__ import annotations

from pipelines.registry import entries


class NotReachable(Exception):
    """Nothing here reaches the device: the message says how to reach it."""


RUNNERS = entries(__name__, ("local", "rpc", "emulated", "docker", "none"))
