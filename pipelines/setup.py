"""What `pock setup` does for the configured devices: the Debian packages their toolchains and
runners need (cross compilers, qemu, mmdebstrap, the Docker engine; as root), their emulation
roots, and a Docker engine started where none answers."""
from __future__ import annotations

import shutil
import subprocess

from pipelines.schema import ConfigError


def needed_packages(profiles, packaged: set[str]) -> dict[str, str]:
    """Tool -> the Debian package that provides it, for what ``profiles`` run and build with
    (``packaged``: the devices a Docker image is made for)."""
    needed = {}
    for profile in profiles:
        if profile.toolchain.cc and profile.toolchain.package:
            needed[profile.toolchain.cc] = profile.toolchain.package
        if profile.runner == "emulated":
            needed.update({profile.emulation.qemu: "qemu-user-static",
                           "mmdebstrap": "mmdebstrap"})
        if profile.runner == "docker" or profile.name in packaged:
            needed.update({"dockerd": "docker.io", "mmdebstrap": "mmdebstrap"})
    return needed


def setup(profiles, packaged: set[str]):
    """Install, make and start what ``profiles`` need; yields a line per thing done."""
    from pipelines.runtime.emulation import emulation_root, root_is_ready, setup_root

    needed = needed_packages(profiles, packaged)
    packages = sorted({package for tool, package in needed.items() if not shutil.which(tool)})
    if packages:
        yield f"apt-get install {' '.join(packages)}"
        subprocess.call(["apt-get", "update", "-q"])
        if subprocess.call(["apt-get", "install", "-y", "-q", *packages]) != 0:
            raise ConfigError(f"apt-get could not install {packages} (root and Debian's "
                              "package registry needed)")
    for profile in profiles:
        if profile.target["kind"] == "cuda" and not shutil.which("nvcc"):
            yield (f"warning: {profile.name} compiles CUDA kernels with nvcc, which is not on "
                   "PATH (NVIDIA's CUDA toolkit; not installed by pock setup)")
        if profile.runner == "emulated":
            root = emulation_root(profile)
            if not root_is_ready(root):
                yield f"emulation root for {profile.name}: {setup_root(profile, root)}"
    if "dockerd" in needed:
        from pipelines.runtime.images import start_engine

        yield f"docker: {start_engine()}"
