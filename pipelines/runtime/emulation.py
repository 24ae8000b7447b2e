"""Making the root an emulated device runs in: a minimal Debian for the device's architecture
(python3 and the C++ runtime, extracted by mmdebstrap, no maintainer scripts and so no qemu
needed to make it) plus the device's wheels of TVM and numpy, at the versions installed here.

Used by `pock emulation setup <device>` and `pock setup` (which .ci/run runs). Needs Debian's mmdebstrap and
qemu-user-static, and the Debian and PyPI registries.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from pipelines.schema import ConfigError

# target mtriple's architecture -> (Debian architecture, pip platform tags of its wheels).
# Emulation needs a foreign one (aarch64); pipelines/runtime/images.py uses both.
ARCHITECTURES = {"aarch64": ("arm64", ["manylinux_2_28_aarch64", "manylinux2014_aarch64"]),
                 "x86_64": ("amd64", ["manylinux_2_28_x86_64", "manylinux2014_x86_64",
                                      "manylinux_2_17_x86_64",
                                      "manylinux_2_27_x86_64"])}  # LiteRT's
DEBIAN = ["python3", "libstdc++6", "libgomp1"]
NATIVE_DEBIAN = ["libstdc++6"]  # all the native runner and TVM's runtime libraries load
# ... and none of its documentation, translations, debugger scripts or iconv's character-set
# modules (the runner converts no text between encodings)
NATIVE_DROP = ("./usr/share/doc/*", "./usr/share/locale/*", "./usr/share/lintian/*",
               "./usr/share/gcc/*", "./usr/share/gdb/*", "./usr/lib/*/gconv/*")
WHEELS = ["apache-tvm", "apache-tvm-ffi", "numpy", "ml_dtypes", "typing_extensions"]


def emulation_root(profile) -> Path:
    return Path(str(profile.emulation.root)).expanduser()


def root_is_ready(root: Path) -> bool:
    """Whether ``root`` holds the device's python3 and TVM (what setup_root makes)."""
    return (root / "usr/bin/python3").exists() and (root / "opt/pockengine/tvm").exists()


def device_architecture(profile, what: str) -> str:
    """The profile's CPU architecture (from target.mtriple, or host.mtriple for a GPU), if
    ``what`` (emulation, a container image) supports it."""
    arch = profile.cpu_architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{profile.source}: the CPU's mtriple gives "
                          f"{arch!r}; {what} supports the architectures {sorted(ARCHITECTURES)}")
    return arch


def debian_command(arch: str, output: Path, packages: list[str] = DEBIAN) -> list[str]:
    """mmdebstrap making a minimal Debian of ``packages`` (and what they depend on) for
    ``arch`` at ``output`` (a directory or a .tar).
    The extract variant only unpacks packages (no maintainer scripts), so a foreign
    architecture needs no qemu to be made."""
    if shutil.which("mmdebstrap") is None:
        raise ConfigError("mmdebstrap is not on PATH; install the Debian package mmdebstrap")
    return ["mmdebstrap", "--quiet", "--variant=extract",
            f"--architectures={ARCHITECTURES[arch][0]}", f"--include={','.join(packages)}",
            "bookworm", str(output)]


def install_wheels(arch: str, target: Path, wheels: list[str] = WHEELS) -> None:
    """The device's ``wheels`` (TVM and numpy; the versions installed here) into ``target``;
    not byte-compiled, so the same wheels give the same files."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--target", str(target), "--only-binary=:all:",
                    "--implementation", "cp", "--python-version", python,
                    *[f"--platform={p}" for p in ARCHITECTURES[arch][1]],
                    *[f"{w}=={version(w)}" for w in wheels]], check=True)


def setup_root(profile, root: Path) -> Path:
    arch = device_architecture(profile, "emulation")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:  # all or nothing
        staging = Path(tmp) / "root"
        subprocess.run(debian_command(arch, staging), check=True)
        install_wheels(arch, staging / "opt/pockengine")
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    return root
