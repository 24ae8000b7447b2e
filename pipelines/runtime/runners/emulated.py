"""The device's CPU emulated here: qemu user mode runs on_device.py with the python3 of an
aarch64 root (``emulation``; made by `pock emulation setup`, runtime/emulation.py). Its step
times are qemu's, labelled emulated, never compared with a device's."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from pydantic import PositiveFloat

from pipelines.runtime.device_io import ON_DEVICE, read_outputs, save_inputs
from pipelines.runtime.emulation import emulation_root, root_is_ready
from pipelines.schema import ConfigError, Strict

SECTION = "emulation"
TAKES_ARCHIVE = False
RUNS_HERE = False
LABEL = "emulated"


class Config(Strict):
    """A profile's ``emulation``: qemu's user-mode binary and the root the device's python3
    and TVM live in."""

    qemu: str
    root: str
    timeout_s: PositiveFloat = 900


def requirements(profile) -> dict[str, str]:
    return {profile.emulation.qemu: "qemu-user-static", "mmdebstrap": "mmdebstrap"}


def prepare(profile) -> str | None:
    """The emulation root, made where it is missing."""
    from pipelines.runtime.emulation import setup_root

    root = emulation_root(profile)
    if root_is_ready(root):
        return None
    return f"emulation root for {profile.name}: {setup_root(profile, root)}"


def check_emulation(profile) -> tuple[str, Path]:
    """qemu and the aarch64 root the profile names, or an error saying how to get them."""
    source = f"device_profiles/{profile.name}.yaml"
    qemu = shutil.which(profile.emulation.qemu)
    if qemu is None:
        raise ConfigError(f"{source}: emulation.qemu={profile.emulation.qemu!r} is not on "
                          "PATH; install the Debian package qemu-user-static")
    root = emulation_root(profile)
    if not root_is_ready(root):
        raise ConfigError(f"{source}: emulation.root={root} holds no emulation root (python3 "
                          f"and TVM for the device); make it with `pock emulation setup "
                          f"{profile.name}`")
    return qemu, root


def run(library: Path, args: list, profile, warmup: int, steps: int):
    """on_device.py under qemu user mode (-L makes the root the guest's /; paths outside it,
    such as this checkout, fall through to the host's)."""
    qemu, root = check_emulation(profile)
    timeout = profile.emulation.timeout_s
    with tempfile.TemporaryDirectory(prefix="pock-emulated-") as tmp:
        inputs, outputs = Path(tmp) / "inputs.npz", Path(tmp) / "outputs.npz"
        save_inputs(inputs, args)
        command = [qemu, "-L", str(root), str(root / "usr/bin/python3"), str(ON_DEVICE),
                   str(Path(library).resolve()), str(inputs), str(outputs), str(warmup),
                   str(steps)]
        env = {"PYTHONPATH": str(root / "opt/pockengine"), "PYTHONNOUSERSITE": "1",
               "TVM_NUM_THREADS": str(profile.cores), "HOME": tmp}
        try:
            ran = subprocess.run(command, env=env, capture_output=True, text=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"emulated run of {library}: over {timeout:.0f} s "
                               "(emulation.timeout_s)") from err
        if ran.returncode != 0:
            raise RuntimeError(f"emulated run of {library} failed:\n{ran.stderr[-3000:]}")
        return read_outputs(outputs)
