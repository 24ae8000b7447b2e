"""What `pock setup` does for the configured devices: the Debian packages their toolchains and
runners need (cross compilers; qemu and mmdebstrap for emulation, the Docker engine for
containers: each runner's ``requirements``), as root; then what each runner makes once they are
installed (an emulation root, a running engine: its ``prepare``)."""
from __future__ import annotations

import shutil
import subprocess

from pipelines.runtime.runners import RUNNERS
from pipelines.schema import ConfigError

# A device a Docker image is made for (package.devices) runs it in a container, as this runner.
CONTAINER = RUNNERS["docker"]


def _runners(profile, packaged: set[str]) -> list:
    runners = [RUNNERS[profile.runner]]
    return runners + [CONTAINER] if profile.name in packaged else runners


def needed_packages(profiles, packaged: set[str]) -> dict[str, str]:
    """Tool -> the Debian package that provides it, for what ``profiles`` build and run with
    (``packaged``: the devices a Docker image is made for)."""
    needed = {}
    for profile in profiles:
        if profile.toolchain.cc and profile.toolchain.package:
            needed[profile.toolchain.cc] = profile.toolchain.package
        for runner in _runners(profile, packaged):
            if hasattr(runner, "requirements"):
                needed.update(runner.requirements(profile))
    return needed


def setup(profiles, packaged: set[str]):
    """Install, make and start what ``profiles`` need; yields a line per thing done."""
    packages = sorted({package for tool, package in needed_packages(profiles, packaged).items()
                       if not shutil.which(tool)})
    if packages:
        yield f"apt-get install {' '.join(packages)}"
        subprocess.call(["apt-get", "update", "-q"])
        if subprocess.call(["apt-get", "install", "-y", "-q", *packages]) != 0:
            raise ConfigError(f"apt-get could not install {packages} (root and Debian's "
                              "package registry needed)")
    said = set()
    for profile in profiles:
        if profile.target["kind"] == "cuda" and not shutil.which("nvcc"):
            yield (f"warning: {profile.name} compiles CUDA kernels with nvcc, which is not on "
                   "PATH (NVIDIA's CUDA toolkit; not installed by pock setup)")
        for runner in _runners(profile, packaged):
            line = runner.prepare(profile) if hasattr(runner, "prepare") else None
            if line is not None and line not in said:  # each prepare is idempotent
                said.add(line)
                yield line
