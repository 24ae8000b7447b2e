"""What the runners that run a step off this process share: the script that runs it with only
TVM's runtime and numpy (on_device.py), the libraries that travel with the step, its output file
and time limits."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

ON_DEVICE = Path(__file__).with_name("on_device.py")
PEER_IN_CONTAINER = Path(__file__).with_name("peer_in_container.py")
TFLITE_IN_CONTAINER = Path(__file__).with_name("tflite_in_container.py")
TENSORFLOW_IN_CONTAINER = Path(__file__).with_name("tensorflow_in_container.py")
ORT_IN_CONTAINER = Path(__file__).with_name("ort_in_container.py")
EXECUTORCH_IN_CONTAINER = Path(__file__).with_name("executorch_in_container.py")
SAMPLED_PEAK = Path(__file__).with_name("sampled_peak.py")  # the scripts import it


def libraries_beside(library: Path) -> list[Path]:
    """The shared libraries the step loads from its own directory (OpenBLAS, where products run
    on it: pipelines/backend/blas.py)."""
    return sorted(p for p in Path(library).parent.glob("*.so") if p.name != Path(library).name)


def with_timeout(seconds: float, what: str, function):
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
        raise TimeoutError(f"{what}: no answer within {seconds:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def save_inputs(path: Path, args: list[np.ndarray]) -> None:
    np.savez(path, **{f"arg_{i:03d}": a for i, a in enumerate(args)})


def read_outputs(path: Path) -> tuple[list[np.ndarray], list[float], dict]:
    """on_device.py's output file: the step's outputs, step times and peak memory."""
    with np.load(path) as data:
        results = [data[n] for n in sorted(data.files) if n.startswith("out_")]
        return (results, [float(t) for t in data["times_ms"]],
                {"peak_rss_bytes": int(data["peak_rss_bytes"])})
