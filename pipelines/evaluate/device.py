"""A case's build for a device, run where the profile's runner reaches it (benchmark@<case>-<device>):

- rpc / emulated / docker: one step on the device (a TVM RPC server; qemu user mode; a
  container limited to the profile's cores and memory) checked against the host build's step on
  the same arguments (loss and every updated tensor), then step times: measured on the device by
  TVM's time_evaluator (rpc), or labelled ``emulated`` or ``container`` (this machine's cores,
  not the device's; never compared with real timings). ``verdict`` is ``ok``, or
  ``out_of_memory`` when the step did not fit in the container's memory_mb: recorded (the
  device's answer, not a crash of the pipeline). In a container, the native runner (what a
  package ships: no Python) then runs the same build in the same limits (``native``), and the
  peers the profile names (``docker.peers``) train the case there, each with its verdict
  (``peers``: container_peers.py), compared with the native runner's run;
- local: this machine (another build for it, e.g. another -mcpu): checked and timed here;
- none: nothing here reaches the device; the result says so, and how to reach it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.phases import Build
from pipelines.runtime.agreement import adam_first_moments, compare


def reference_outputs(build, initial: dict, batch: tuple) -> dict[str, np.ndarray]:
    """The outputs of one step of the build in ``build`` from ``initial`` on ``batch`` (the
    loss, then each new state tensor), by output name: what another build of the same step
    must give on the same arguments (phases.Reference, reference@<case>)."""
    from pipelines.runtime.step import CompiledStep

    step = CompiledStep(build, initial)
    outputs = step.function(*step.arguments(*batch))
    return {name: value.numpy() for name, value in zip(step.signature["outputs"], outputs)}


def run_on_device(device: str, profile, build: Path, initial: dict, batch: tuple,
                  reference: list[np.ndarray], warmup: int, steps: int, model=None,
                  optimizer=None) -> dict:
    """What ran where, checked against the host build's outputs ``reference`` on the same
    arguments (reference@: the loss, then every updated tensor); see the module docstring. In a
    container whose profile names PyTorch peers, they train ``model`` with ``optimizer`` (the
    case's) after it (container_peers.py)."""
    built = Build.load(build)
    metrics = _run_build(device, profile, built, initial, batch, reference, warmup, steps)
    if profile.runner == "docker" and metrics.get("verdict") == "ok":
        metrics["native"] = _run_native(build, initial, batch, profile, warmup + steps)
    peers = profile.docker.peers if profile.runner == "docker" and profile.docker else []
    if peers and metrics["ran"]:
        from pipelines.evaluate.container_peers import run_peers

        metrics["peers"] = run_peers(profile, peers, model, built.signature, initial,
                                     optimizer, batch, float(reference[0]), warmup, steps)
        metrics.update(peer_ratios(metrics))
    return metrics


def _run_native(build: Path, initial: dict, batch: tuple, profile, steps: int) -> dict:
    """The native runner's run in the same limits (runners/docker.py: run_native), its first
    loss checked against the Python runner's on the same build and batch."""
    from pipelines.runtime.images import OutOfMemory
    from pipelines.runtime.runners.docker import run_native

    try:
        native = run_native(build, initial, batch, profile, steps)
    except OutOfMemory as err:
        return {"verdict": "out_of_memory", "reason": str(err).splitlines()[0]}
    return {"verdict": "ok", **native, "matches": bool(np.isclose(
        native["first_loss"], native["first_loss_python"], rtol=1e-6, atol=0))}


def shipped(metrics: dict) -> dict:
    """The compiled step's step time and peak memory as a device runs it: the native runner's
    where it ran (docker), else the runner's that checked the step."""
    native = metrics.get("native", {})
    if native.get("verdict") == "ok" and native["matches"]:
        return {"median_ms": native["median_ms"], "peak_rss_bytes": native["peak_rss_bytes"]}
    return {"median_ms": metrics["container"]["median_ms"],
            "peak_rss_bytes": metrics["peak_rss_bytes"]}


def peer_ratios(metrics: dict) -> dict:
    """The compiled step as a device runs it (``shipped``) against each peer that ran beside it
    in the same container, each a whole process: its speedup (the peer's step time over its
    own) and its memory (its peak over the peer's), as evaluate@ names them."""
    if metrics.get("verdict") != "ok":
        return {}
    ratios, own = {}, shipped(metrics)
    for peer, r in metrics["peers"].items():
        if r["verdict"] == "ok":
            ratios[f"speedup_vs_{peer}"] = r["container"]["median_ms"] / own["median_ms"]
            ratios[f"memory_vs_{peer}"] = own["peak_rss_bytes"] / r["peak_rss_bytes"]
    return ratios


def _run_build(device: str, profile, built, initial: dict, batch: tuple,
               reference: list[np.ndarray], warmup: int, steps: int) -> dict:
    from pipelines.runtime.images import OutOfMemory
    from pipelines.runtime.runners import RUNNERS, NotReachable
    from pipelines.runtime.step import initial_state

    head = {"device": device, "runner": profile.runner}
    signature = built.signature
    state = initial_state(signature, initial)  # the device's library is not loaded here
    args = ([np.ascontiguousarray(a) for a in batch]
            + [state[name] for name in signature["inputs"][len(signature["data"]):]])
    before = [None] + [state[name.removeprefix("new_")] for name in signature["outputs"][1:]]
    runner = RUNNERS[profile.runner]
    try:
        got, times, info = runner.run(built.library, args, profile, warmup, steps)
    except NotReachable as err:
        return {**head, "ran": False, "reason": str(err)}
    except OutOfMemory as err:
        return {**head, "ran": True, "verdict": "out_of_memory",
                "memory_mb": profile.memory_mb, "reason": str(err).splitlines()[0]}
    timing = {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
              "steps": len(times)}
    return {
        **head, "ran": True, "verdict": "ok", **info,
        "loss": float(got[0]), "loss_host": float(reference[0]),
        **compare(got, reference, before, adam_first_moments(signature, got, reference)),
        # Emulated time is qemu's and container time this machine's, not the device's: kept
        # apart from real timings.
        runner.LABEL: timing,
    }


def summary(metrics: dict) -> str:
    """A line on what ran where and how it compares, one on the native runner where it ran,
    and one per peer beside it."""
    native = metrics.get("native")
    return "\n".join([_summary(metrics), *([] if native is None else [
        f"  native runner: {native['verdict']}" + (
            f", peak {native['peak_rss_bytes'] / 2**20:.0f} MiB, loss {native['first_loss']:.6f} "
            f"{'matches' if native['matches'] else 'DOES NOT MATCH'} the Python runner's; "
            f"{native['median_ms']:.2f} ms/step" if native["verdict"] == "ok"
            else f" ({native['reason']})")]), *(
        f"  {peer}: " + (f"{r['verdict']} ({r['reason']})" if "reason" in r else
                         f"ok, peak {r['peak_rss_bytes'] / 2**20:.0f} MiB, loss {r['loss']:.6f} "
                         f"{'matches' if r['matches_host'] else 'DOES NOT MATCH'} the host "
                         f"build's; {r['container']['median_ms']:.2f} ms/step")
        for peer, r in metrics.get("peers", {}).items())])


def _summary(metrics: dict) -> str:
    device = f"{metrics['device']}"
    if not metrics["ran"]:
        return f"{device}: not run ({metrics['reason']})"
    if metrics["verdict"] == "out_of_memory":
        return f"{device}: {metrics['runner']}, OUT OF MEMORY ({metrics['reason']})"
    label = next(k for k in ("compiled", "emulated", "container") if k in metrics)
    return (f"{device}: {metrics['runner']}, loss {metrics['loss']:.6f} "
            f"{'matches' if metrics['matches_host'] else 'DOES NOT MATCH'} the host build's "
            f"{metrics['loss_host']:.6f}; {metrics[label]['median_ms']:.2f} ms/step"
            + {"compiled": "", "emulated": " (emulated, not the device's speed)",
               "container": " (in a container on this machine's cores)"}[label])
