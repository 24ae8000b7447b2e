"""Making the root an emulated device runs in: a minimal Debian for the device's architecture
(python3 and the C++ runtime, extracted by mmdebstrap, no maintainer scripts and so no qemu
needed to make it) plus the device's wheels of TVM and numpy, at the versions installed here.

Used by `pock emulation setup <device>` and by .ci/run. Needs Debian's mmdebstrap and
qemu-user-static, and the Debian and PyPI registries.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from pipelines.config import PROFILES, ConfigError

# target mtriple's architecture -> (Debian architecture, pip platform tags of its wheels)
ARCHITECTURES = {"aarch64": ("arm64", ["manylinux_2_28_aarch64", "manylinux2014_aarch64"])}
DEBIAN = ["python3", "libstdc++6", "libgomp1"]
WHEELS = ["apache-tvm", "apache-tvm-ffi", "numpy", "ml_dtypes", "typing_extensions"]


def emulation_root(profile: dict) -> Path:
    return Path(str(profile["emulation"]["root"])).expanduser()


def root_is_ready(root: Path) -> bool:
    """Whether ``root`` holds the device's python3 and TVM (what setup_root makes)."""
    return (root / "usr/bin/python3").exists() and (root / "opt/pockengine/tvm").exists()


def setup_root(profile: dict, root: Path) -> Path:
    source = f"{PROFILES.name}/{profile['name']}.yaml"
    arch = str(profile["target"].get("mtriple", "")).split("-")[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: target.mtriple={profile['target'].get('mtriple')!r}; "
                          f"emulation supports the architectures {sorted(ARCHITECTURES)}")
    if shutil.which("mmdebstrap") is None:
        raise ConfigError("mmdebstrap is not on PATH; install the Debian package mmdebstrap")
    debian_arch, platforms = ARCHITECTURES[arch]
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:  # all or nothing
        staging = Path(tmp) / "root"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=extract",
                        f"--architectures={debian_arch}", f"--include={','.join(DEBIAN)}",
                        "bookworm", str(staging)], check=True)
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(staging / "opt/pockengine"), "--only-binary=:all:",
                        "--implementation", "cp", "--python-version", python,
                        *[f"--platform={p}" for p in platforms],
                        *[f"{w}=={version(w)}" for w in WHEELS]], check=True)
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    return root
