"""This machine's CPU in a container limited to the profile's cores and memory (no swap, no
network), running on_device.py in the runtime image (Debian, TVM, numpy: runtime/images.py). A
step that does not fit the memory is killed as it would be on the device, and recorded as out
of memory. Its step times are this machine's cores, labelled container. Peers
(``docker.peers``) train the same case in the same limits, in the PyTorch image (with a C++
compiler for ``torch.compile``), TensorFlow's, LiteRT's, ONNX Runtime's or ExecuTorch's
(pipelines/evaluate/container_peers.py)."""
from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import PositiveFloat

from pipelines.runtime.device_io import (EXECUTORCH_IN_CONTAINER, ON_DEVICE, ORT_IN_CONTAINER,
                                         PEER_IN_CONTAINER, SAMPLED_PEAK,
                                         TENSORFLOW_IN_CONTAINER, TFLITE_IN_CONTAINER,
                                         libraries_beside, read_outputs, save_inputs)
from pipelines.schema import Strict

SECTION = "docker"
TAKES_ARCHIVE = False
RUNS_HERE = True
LABEL = "container"


class Config(Strict):
    """A profile's ``docker``: how long a container may run, and which peers train the case in
    the same limits after the compiled step (PyTorch eager full backpropagation; eager with the
    scheme's frozen layers frozen; ``torch.compile`` full backpropagation; PEFT LoRA, for a
    LoRA case; TensorFlow and TFLite, full or frozen, for MobileNetV2; ONNX Runtime training,
    full or frozen; ExecuTorch training, full or frozen, with SGD)."""

    timeout_s: PositiveFloat = 900
    peers: list[Literal["torch_eager_full", "torch_eager_frozen", "torch_compile_full",
                        "peft_lora", "tensorflow_full", "tensorflow_frozen", "tflite_full",
                        "tflite_frozen", "ort_training_full", "ort_training_frozen",
                        "executorch_full", "executorch_frozen"]] = []


def check(profile) -> None:
    if profile.target["kind"] != "llvm" or profile.cpu_architecture != platform.machine():
        raise ValueError(f"runner='docker' runs the build on this machine's CPU "
                         f"({platform.machine()}), but target is {profile.target}; allowed: an "
                         f"llvm target with mtriple {platform.machine()}-linux-gnu (for another "
                         "CPU: emulated, rpc or none)")


def requirements(profile) -> dict[str, str]:
    return {"dockerd": "docker.io", "mmdebstrap": "mmdebstrap"}


def prepare(profile) -> str | None:
    """A Docker engine, started where none answers."""
    from pipelines.runtime.images import start_engine

    return f"docker: {start_engine()}"


def _image(profile, layers, name: str) -> tuple:
    """The engine, and the image of ``layers`` for the profile's architecture, loaded."""
    from pipelines.runtime.emulation import ARCHITECTURES, device_architecture
    from pipelines.runtime.images import engine, ensure_image

    client = engine()
    arch = device_architecture(profile, "a container image")
    return client, ensure_image(client, arch, layers(arch), {},
                                f"pockengine/{name}-{ARCHITECTURES[arch][0]}")


def run(library: Path, args: list, profile, warmup: int, steps: int):
    """Raises images.OutOfMemory when the step does not fit."""
    from pipelines.runtime.images import run_limited, runtime_layers

    client, image = _image(profile, runtime_layers, "runtime")
    timeout = (profile.docker or Config()).timeout_s
    with tempfile.TemporaryDirectory(prefix="pock-docker-") as tmp:
        io = Path(tmp)
        save_inputs(io / "inputs.npz", args)
        for script in (ON_DEVICE, SAMPLED_PEAK):
            shutil.copy(script, io / script.name)
        shutil.copy(library, io / "step.so")
        for beside in libraries_beside(library):  # as for RPC
            shutil.copy(beside, io / beside.name)
        run_limited(client, image["id"], ["python3", f"/io/{ON_DEVICE.name}", "/io/step.so",
                                          "/io/inputs.npz", "/io/outputs.npz", str(warmup),
                                          str(steps)],
                    profile, {io: ("/io", "rw")}, timeout)
        outputs, times, info = read_outputs(io / "outputs.npz")
    return outputs, times, {**info, "image": image["tag"], "image_id": image["id"]}


def run_native(build_dir: Path, initial: dict, batch: tuple, profile, steps: int) -> dict:
    """The native runner (C++, no Python: what package@ ships) stepping the build in
    ``build_dir`` from ``initial`` ``steps`` times on ``batch``, in the profile's limits, in
    the minimal Debian it needs; its time per step (the median after the first, which sets up
    the VM's memory pools), the whole process's peak memory and first loss, beside the first
    loss of the Python runner (python_runner.py, here) on the same build and data: the runners
    take the same seeded shuffle of the examples, so their first batches are the same. Raises
    images.OutOfMemory when it does not fit."""
    import numpy as np

    from pipelines.runtime.emulation import NATIVE_DEBIAN, NATIVE_DROP
    from pipelines.runtime.images import debian_layer, run_limited
    from pipelines.runtime.native import build_runner, run_python, save_data, step_directory

    client, image = _image(profile, lambda arch: [debian_layer(arch, NATIVE_DEBIAN, NATIVE_DROP)],
                           "native")
    signature = json.loads((Path(build_dir) / "signature.json").read_text())
    timeout = (profile.docker or Config()).timeout_s
    with tempfile.TemporaryDirectory(prefix="pock-docker-") as tmp:
        app, data, out, python = (Path(tmp, name) for name in ("app", "data", "out", "python"))
        build_runner(profile, app)  # the runner and the step in one directory, as in a package
        step_directory(build_dir, initial, app)
        for directory in (data, out, python):
            directory.mkdir()
        save_data(data / "train.safetensors", signature,
                  tuple(np.concatenate([a] * steps) for a in batch))
        run_limited(client, image["id"], ["/app/runner", "/app", "--data", "/data", "--out",
                                          "/out", "--steps", str(steps)], profile,
                    {app: ("/app", "ro"), data: ("/data", "ro"), out: ("/out", "rw")}, timeout)
        log = json.loads((out / "log.json").read_text())
        checked = run_python(app, data, python, int(profile.cores), timeout, ("--steps", "1"))
    return {"median_ms": float(np.median(log["step_ms"][1:] or log["step_ms"])),
            "steps": log["steps"], "peak_rss_bytes": log["peak_rss_bytes"],
            "first_loss": log["losses"][0], "first_loss_python": checked["losses"][0],
            "image": image["tag"]}


def _run_script(profile, layers, name: str, script: Path, files: dict, arguments: list) -> dict:
    """``script`` (sampled_peak.py beside it) run in the image of ``layers`` in the profile's
    limits, on ``files`` (a name in /io -> a path to copy, or bytes) and ``arguments`` (after
    its output file, /io/output.json, they follow the files' paths); its output and the
    image's tag. Raises images.OutOfMemory when it does not fit."""
    from pipelines.runtime.images import run_limited

    client, image = _image(profile, layers, name)
    with tempfile.TemporaryDirectory(prefix="pock-docker-") as tmp:
        io = Path(tmp)
        for file, content in files.items():
            if isinstance(content, bytes):
                (io / file).write_bytes(content)
            elif Path(content).is_dir():
                shutil.copytree(content, io / file)
            else:
                shutil.copy(content, io / file)
        for beside in (script, SAMPLED_PEAK):
            shutil.copy(beside, io / beside.name)
        run_limited(client, image["id"], ["python3", f"/io/{script.name}",
                                          *[f"/io/{file}" for file in files],
                                          "/io/output.json", *map(str, arguments)],
                    profile, {io: ("/io", "rw")}, (profile.docker or Config()).timeout_s)
        return {**json.loads((io / "output.json").read_text()), "image": image["tag"]}


def run_peer(program: Path, plan: dict, args: list, profile, warmup: int, steps: int) -> dict:
    """peer_in_container.py's results for ``program`` (the model and its loss, saved by
    torch.export) trained as ``plan`` says on ``args``, in the PyTorch image in the profile's
    limits (with g++ and the headers where the plan compiles the step); raises
    images.OutOfMemory when it does not fit."""
    from pipelines.runtime.images import pytorch_layers, torch_compile_layers

    layers, name = ((torch_compile_layers, "pytorch-compile") if plan["compile"]
                    else (pytorch_layers, "pytorch"))
    return _run_script(profile, layers, name, PEER_IN_CONTAINER,
                       {"program.pt2": program, "plan.json": json.dumps(plan).encode(),
                        "inputs.npz": _npz(args)}, [warmup, steps])


def run_tensorflow_peer(saved: Path, inputs: dict, profile, warmup: int, steps: int) -> dict:
    """tensorflow_in_container.py's results for ``saved`` (a SavedModel directory with a
    ``train`` signature) on ``inputs`` (its arguments by name), in the TensorFlow image in the
    profile's limits; raises images.OutOfMemory when it does not fit."""
    from pipelines.runtime.images import tensorflow_layers

    return _run_script(profile, tensorflow_layers, "tensorflow", TENSORFLOW_IN_CONTAINER,
                       {"saved_model": saved, "inputs.npz": _npz(inputs)},
                       [warmup, steps, profile.cores])


def run_tflite_peer(model: bytes, inputs: dict, profile, warmup: int, steps: int) -> dict:
    """tflite_in_container.py's results for ``model`` (a TFLite model with a ``train``
    signature) on ``inputs`` (its arguments by name), in the LiteRT image in the profile's
    limits; raises images.OutOfMemory when it does not fit."""
    from pipelines.runtime.images import litert_layers

    return _run_script(profile, litert_layers, "litert", TFLITE_IN_CONTAINER,
                       {"model.tflite": model, "inputs.npz": _npz(inputs)},
                       [warmup, steps, profile.cores])


def run_ort_peer(artifacts: Path, args: list, lr: float, profile, warmup: int,
                 steps: int) -> dict:
    """ort_in_container.py's results for ONNX Runtime's training ``artifacts`` (a directory)
    on ``args`` (the training model's inputs, the labels last) at learning rate ``lr``, in the
    ONNX Runtime image in the profile's limits; raises images.OutOfMemory when it does not
    fit."""
    from pipelines.runtime.images import ort_layers

    return _run_script(profile, ort_layers, "onnxruntime", ORT_IN_CONTAINER,
                       {"artifacts": artifacts, "inputs.npz": _npz(args)},
                       [warmup, steps, profile.cores, lr])


def run_executorch_peer(program: bytes, args: list, sgd, profile, warmup: int,
                        steps: int) -> dict:
    """executorch_in_container.py's results for ``program`` (an ExecuTorch training program)
    on ``args`` (its inputs, the labels last) with ``sgd`` (a config's SGD), in the ExecuTorch
    image in the profile's limits; raises images.OutOfMemory when it does not fit."""
    from pipelines.runtime.images import executorch_layers

    return _run_script(profile, executorch_layers, "executorch", EXECUTORCH_IN_CONTAINER,
                       {"program.pte": program, "inputs.npz": _npz(args)},
                       [warmup, steps, sgd.lr, sgd.momentum, sgd.weight_decay, sgd.nesterov])


def _npz(arrays) -> bytes:
    """``arrays`` as an .npz file's bytes: a list as arg_000, ... (save_inputs), or by name."""
    import io

    import numpy as np

    if isinstance(arrays, dict):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()
    with tempfile.TemporaryDirectory(prefix="pock-docker-") as tmp:
        save_inputs(Path(tmp) / "inputs.npz", arrays)
        return (Path(tmp) / "inputs.npz").read_bytes()
