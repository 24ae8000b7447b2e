"""A board running TVM's RPC server, found through a tracker under the profile's key
(``remote``): the step is uploaded, run once and timed there by TVM's time_evaluator.

Every call has a time limit: a missing tracker or key is named at once, and a board that stops
answering ends in an error after ``remote.timeout_s``, never a hang.
"""
from __future__ import annotations

import socket
from pathlib import Path

from pydantic import PositiveFloat, field_validator

from pipelines.runtime.device_io import libraries_beside, with_timeout
from pipelines.schema import ConfigError, Strict

SECTION = "remote"
TAKES_ARCHIVE = True
RUNS_HERE = False
LABEL = "compiled"


class Config(Strict):
    """A profile's ``remote``: the tracker (HOST:PORT) and the key its board registers."""

    tracker: str
    key: str
    timeout_s: PositiveFloat = 300

    @field_validator("tracker")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError("allowed: HOST:PORT of a TVM RPC tracker, e.g. 127.0.0.1:9190")
        return value


def session(profile):
    """A session on a server registered with the profile's tracker under its key."""
    from tvm import rpc

    source, remote = f"device_profiles/{profile.name}.yaml", profile.remote
    host, port = remote.tracker.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise ConfigError(f"{source}: no RPC tracker answers at remote.tracker={remote.tracker} "
                          f"({err.strerror or err}); start one with `python -m "
                          f"tvm.exec.rpc_tracker --host {host} --port {port}`") from err
    what = f"RPC tracker (remote.timeout_s={remote.timeout_s:g})"
    tracker = with_timeout(remote.timeout_s, what, lambda: rpc.connect_tracker(host, int(port)))
    keys = sorted(with_timeout(remote.timeout_s, what, tracker.summary)["queue_info"])
    if remote.key not in keys:
        raise ConfigError(f"{source}: remote.key={remote.key!r} is not registered with the "
                          f"tracker at {remote.tracker}; registered keys: {keys}. On the "
                          f"device: python -m tvm.exec.rpc_server --tracker {remote.tracker} "
                          f"--key {remote.key}")
    return with_timeout(remote.timeout_s, f"RPC request for key {remote.key!r}",
                        lambda: tracker.request(remote.key,
                                                session_timeout=remote.timeout_s + 60))


def run(library: Path, args: list, profile, warmup: int, steps: int):
    """Upload ``library``, run one step remotely and fetch its outputs, then time ``steps``
    steps with TVM's time_evaluator on the device (after ``warmup``)."""
    import tvm
    from tvm import relax

    def remote_run():
        remote = session(profile)
        remote.upload(str(library))
        # A step whose products run on OpenBLAS finds that library beside it (rpath $ORIGIN).
        for beside in libraries_beside(library):
            remote.upload(str(beside))
        device = remote.cpu()
        vm = relax.VirtualMachine(remote.load_module(Path(library).name), device)
        vm.set_input("train_step", *[tvm.runtime.tensor(a, device) for a in args])
        vm.invoke_stateful("train_step")
        outputs = [o.numpy() for o in vm.get_outputs("train_step")]
        timer = vm.time_evaluator("invoke_stateful", device, number=1, repeat=warmup + steps)
        times = [t * 1e3 for t in timer("train_step").results][warmup:]
        return outputs, times, {}

    return with_timeout(profile.remote.timeout_s, f"RPC run on {profile.remote.key!r}",
                        remote_run)
