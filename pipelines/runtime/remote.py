"""Running a built step off this process: on a TVM RPC server found through a tracker, on an
aarch64 root under qemu user mode, or in a container limited to the profile's cores and memory.
Each runs one step on given arguments and returns its outputs (compared with the host build's by
the caller), the time of later steps, and what else it learnt (peak memory, the image).

Every call has a time limit: a missing tracker, key or root is named at once, and a device
that stops answering ends in an error after ``timeout_s``, never a hang.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from pipelines.config import ConfigError
from pipelines.profiles import PROFILES
from pipelines.runtime.emulation import emulation_root, root_is_ready

ON_DEVICE = Path(__file__).with_name("on_device.py")


def libraries_beside(library: Path) -> list[Path]:
    """The shared libraries the step loads from its own directory (OpenBLAS, where products run
    on it: pipelines/backend/blas.py)."""
    return sorted(p for p in Path(library).parent.glob("*.so") if p.name != Path(library).name)


def _with_timeout(seconds: float, what: str, function):
    """function() in a daemon thread; its result, its exception, or a TimeoutError."""
    result = {}

    def target():
        try:
            result["value"] = function()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{what}: no answer within {seconds:.0f} s (remote.timeout_s)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def rpc_session(profile: dict):
    """A session on a server registered with the profile's tracker under its key."""
    from tvm import rpc

    source = f"{PROFILES.name}/{profile['name']}.yaml"
    remote = profile["remote"]
    host, port = str(remote["tracker"]).rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise ConfigError(f"{source}: no RPC tracker answers at remote.tracker={remote['tracker']} "
                          f"({err.strerror or err}); start one with `python -m "
                          f"tvm.exec.rpc_tracker --host {host} --port {port}`") from err
    timeout = float(remote.get("timeout_s", 300))
    tracker = _with_timeout(timeout, "RPC tracker", lambda: rpc.connect_tracker(host, int(port)))
    keys = sorted(_with_timeout(timeout, "RPC tracker", tracker.summary)["queue_info"])
    if remote["key"] not in keys:
        raise ConfigError(f"{source}: remote.key={remote['key']!r} is not registered with the "
                          f"tracker at {remote['tracker']}; registered keys: {keys}. On the "
                          f"device: python -m tvm.exec.rpc_server --tracker {remote['tracker']} "
                          f"--key {remote['key']}")
    return _with_timeout(timeout, f"RPC request for key {remote['key']!r}",
                         lambda: tracker.request(remote["key"], session_timeout=timeout + 60))


def run_rpc(library: Path, args: list[np.ndarray], profile: dict, warmup: int,
            steps: int) -> tuple[list[np.ndarray], list[float], dict]:
    """Upload ``library``, run one step remotely and fetch its outputs, then time ``steps``
    steps with TVM's time_evaluator on the device (after ``warmup``)."""
    import tvm
    from tvm import relax

    def remote_run():
        session = rpc_session(profile)
        session.upload(str(library))
        # A step whose products run on OpenBLAS finds that library beside it (rpath $ORIGIN).
        for beside in libraries_beside(library):
            session.upload(str(beside))
        device = session.cpu()
        vm = relax.VirtualMachine(session.load_module(Path(library).name), device)
        remote_args = [tvm.runtime.tensor(a, device) for a in args]
        vm.set_input("train_step", *remote_args)
        vm.invoke_stateful("train_step")
        outputs = [o.numpy() for o in vm.get_outputs("train_step")]
        timer = vm.time_evaluator("invoke_stateful", device, number=1, repeat=warmup + steps)
        times = [t * 1e3 for t in timer("train_step").results][warmup:]
        return outputs, times, {}

    timeout = float(profile["remote"].get("timeout_s", 300))
    return _with_timeout(timeout, f"RPC run on {profile['remote']['key']!r}", remote_run)


def check_emulation(profile: dict) -> tuple[str, Path]:
    """qemu and the aarch64 root the profile names, or an error saying how to get them."""
    source = f"{PROFILES.name}/{profile['name']}.yaml"
    qemu = shutil.which(profile["emulation"]["qemu"])
    if qemu is None:
        raise ConfigError(f"{source}: emulation.qemu={profile['emulation']['qemu']!r} is not on "
                          "PATH; install the Debian package qemu-user-static")
    root = emulation_root(profile)
    if not root_is_ready(root):
        raise ConfigError(f"{source}: emulation.root={root} holds no emulation root (python3 "
                          f"and TVM for the device); make it with `pock emulation setup "
                          f"{profile['name']}`")
    return qemu, root


def _read_outputs(path: Path) -> tuple[list[np.ndarray], list[float], dict]:
    """on_device.py's output file: the step's outputs, step times and peak memory."""
    with np.load(path) as data:
        results = [data[n] for n in sorted(data.files) if n.startswith("out_")]
        return (results, [float(t) for t in data["times_ms"]],
                {"peak_rss_bytes": int(data["peak_rss_bytes"])})


def run_emulated(library: Path, args: list[np.ndarray], profile: dict, warmup: int,
                 steps: int) -> tuple[list[np.ndarray], list[float], dict]:
    """Run on_device.py with the root's python under qemu user mode (-L makes the root the
    guest's /; paths outside it, such as this checkout, fall through to the host's)."""
    qemu, root = check_emulation(profile)
    timeout = float(profile["emulation"].get("timeout_s", 900))
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "inputs.npz", Path(tmp) / "outputs.npz"
        np.savez(inputs, **{f"arg_{i:03d}": a for i, a in enumerate(args)})
        command = [qemu, "-L", str(root), str(root / "usr/bin/python3"), str(ON_DEVICE),
                   str(Path(library).resolve()), str(inputs), str(outputs), str(warmup),
                   str(steps)]
        env = {"PYTHONPATH": str(root / "opt/pockengine"), "PYTHONNOUSERSITE": "1",
               "TVM_NUM_THREADS": str(profile["cores"]), "HOME": tmp}
        try:
            run = subprocess.run(command, env=env, capture_output=True, text=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"emulated run of {library}: over {timeout:.0f} s "
                               "(emulation.timeout_s)") from err
        if run.returncode != 0:
            raise RuntimeError(f"emulated run of {library} failed:\n{run.stderr[-3000:]}")
        return _read_outputs(outputs)


def run_docker(library: Path, args: list[np.ndarray], profile: dict, warmup: int,
               steps: int) -> tuple[list[np.ndarray], list[float], dict]:
    """Run on_device.py in a container of the runtime image (Debian, TVM, numpy) limited to the
    profile's cores and memory. Raises pipelines.runtime.images.OutOfMemory when the step does not fit."""
    from pipelines.runtime.emulation import ARCHITECTURES, device_architecture
    from pipelines.runtime.images import engine, ensure_image, run_limited, runtime_layers

    client = engine()
    arch = device_architecture(profile, "a container image")
    image = ensure_image(client, arch, runtime_layers(arch), {},
                         f"pockengine/runtime-{ARCHITECTURES[arch][0]}")
    timeout = float((profile.get("docker") or {}).get("timeout_s", 900))
    with tempfile.TemporaryDirectory() as tmp:
        io = Path(tmp)
        np.savez(io / "inputs.npz", **{f"arg_{i:03d}": a for i, a in enumerate(args)})
        shutil.copy(ON_DEVICE, io / ON_DEVICE.name)
        shutil.copy(library, io / "step.so")
        for beside in libraries_beside(library):  # as for RPC
            shutil.copy(beside, io / beside.name)
        run_limited(client, image["id"], ["python3", f"/io/{ON_DEVICE.name}", "/io/step.so",
                                          "/io/inputs.npz", "/io/outputs.npz", str(warmup),
                                          str(steps)],
                    profile, {io: ("/io", "rw")}, timeout)
        outputs, times, info = _read_outputs(io / "outputs.npz")
    return outputs, times, {**info, "image": image["tag"], "image_id": image["id"]}
