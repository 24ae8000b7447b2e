"""A runnable Docker image that fine-tunes a case's model on a device (package@<case>-<device>),
with the native runner: no Python in the image.

The image is a minimal Debian for the device's architecture (the C++ runtime only:
emulation.NATIVE_DEBIAN) plus an application layer, /app:
- runner, libtvm_runtime.so, libtvm_ffi.so: the native runner built for the device and TVM's
  runtime libraries (pipelines/runtime/native.py);
- step.so (and what it loads beside it), runner.json and state.safetensors: the device's build
  of the compiled, sparse training step and the weights it starts from;
- package.json: model, scheme, device, batch size and the tensors the data must hold.
  docker run --rm --network none -v $PWD/data:/data:ro -v $PWD/out:/out IMAGE --epochs 2
fine-tunes on data/train.safetensors and writes out/weights.safetensors (the source model's
names), out/state.safetensors and out/log.json (native_runner.cc says more; `IMAGE --help`).
Outputs (artifacts/cases/<case>/<device>/package/): runner/, the runner and the runtime
libraries (what a device without Docker runs); app.tar, the application layer (reproducible
bytes); image.json: the image ID (a hash of its content), its tag and layers, and how to run it.
The image is loaded into the local Docker engine; an engine without it gets it rebuilt from the
same layers, with the same ID.
Then a trial on ``package.trial_steps`` batches of seeded data: the image, run as shipped in a
container limited to the profile's cores and memory (no swap, no network), or, for a CPU this
machine's containers cannot run, the runner under the profile's qemu in its emulated root. The
Python runner (python_runner.py) runs the same batches on the same build (on the host's build,
for an emulated CPU): the two must agree, losses and weights (bit for bit on one build; to the
device tolerance of runtime/agreement.py across builds). Metrics
(artifacts/metrics/package/<case>-<device>.json): the verdict (ok, out_of_memory, or not_run),
and for both runners time per step, peak memory and what their image holds.
"""
from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from pipelines.io import load_tensors, write_json_atomic
from pipelines.runtime.agreement import compare
from pipelines.runtime.emulation import NATIVE_DEBIAN, NATIVE_DROP, emulation_root, root_is_ready
from pipelines.runtime.images import (OutOfMemory, add_tree, debian_layer, engine, ensure_image,
                                      packageable, run_limited, runs_here, runtime_layers)
from pipelines.runtime.native import (build_runner, data_manifest, run_native, run_python,
                                      save_data, step_directory)
from pipelines.runtime.step import synthetic_batch

APP = "/app"


def data_inputs(signature: dict) -> dict:
    """The tensors train.safetensors must hold: the step's data inputs, N examples first."""
    return {d["name"]: {"dtype": d["dtype"], "shape": ["N", *d["example"]]}
            for d in data_manifest(signature)["data"]}


def app_layer(runner_dir: Path, step_dir: Path, about: dict, path: Path) -> None:
    """The /app layer as a reproducible tar at ``path``: the runner, the step directory and
    package.json."""
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp)
        for source in [*runner_dir.iterdir(), *step_dir.iterdir()]:
            shutil.copyfile(source, app / source.name)
        write_json_atomic(app / "package.json", about)
        for file in app.iterdir():
            file.chmod(0o755 if file.name == "runner" else 0o644)
        app.chmod(0o755)
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            add_tree(tar, app, APP.strip("/"))


def make_package(device: str, profile, build_dir: Path, initial: dict, about: dict,
                 out_dir: Path) -> dict:
    """runner/, app.tar and image.json for ``device`` in ``out_dir``; the image loaded in the
    engine."""
    arch = packageable(profile)
    client = engine()
    build_runner(profile, out_dir / "runner")
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = step_directory(build_dir, initial, Path(tmp))
        app_layer(out_dir / "runner", step_dir, about, out_dir / "app.tar")
    repository = f"pockengine/{about['case']}-{device}".lower()
    layers = [debian_layer(arch, NATIVE_DEBIAN, NATIVE_DROP), out_dir / "app.tar"]
    image = ensure_image(client, arch, layers,
                         {"Entrypoint": [f"{APP}/runner", APP, "--data", "/data", "--out", "/out"],
                          "WorkingDir": APP, "Env": ["PATH=/usr/bin:/bin"]}, repository)
    image["bytes"] = sum(layer["bytes"] for layer in image["layers"])
    image["run"] = (f"docker run --rm --network none -v $PWD/data:/data:ro -v $PWD/out:/out "
                    f"{image['tag']} --epochs 1")
    write_json_atomic(out_dir / "image.json", {**about, "image": image})
    return image


def agreement(native: Path, python: Path, step_dir: Path) -> dict:
    """Whether the runners' runs in ``native`` and ``python`` agree: the same batches, losses
    and weights (the weights they started from, in ``step_dir``, tell a flipped ReLU6
    gradient from a wrong update: agreement.compare)."""
    source = json.loads((step_dir / "runner.json").read_text())["weights"]
    start = {source[n]: v for n, v in load_tensors(step_dir / "state.safetensors").items()
             if n in source}
    logs = [json.loads((d / "log.json").read_text()) for d in (native, python)]
    if logs[0]["order"] != logs[1]["order"]:
        raise RuntimeError("the native and the Python runner took different batches")
    weights = [load_tensors(d / "weights.safetensors") for d in (native, python)]
    names = sorted(weights[1])
    got, want = ([np.float32(log["losses"])] + [w[n] for n in names]
                 for log, w in zip(logs, weights))
    result = compare(got, want, [None] + [start[n] for n in names])
    return {"matches_python": result["matches_host"] and sorted(weights[0]) == names,
            "bit_identical": all(np.array_equal(g, w) for g, w in zip(got, want)),
            "worst_diff_over_tolerance": result["worst_diff_over_tolerance"]}


def figures(log: dict) -> dict:
    """A runner's time per step (the median after the first, which sets up the VM's memory
    pools), peak memory and seconds in all."""
    return {"ms_per_step": float(np.median(log["step_ms"][1:] or log["step_ms"])),
            "peak_rss_bytes": log["peak_rss_bytes"], "seconds": log["seconds"]}


def trial(image: dict, profile, runner_dir: Path, build_dir: Path, reference_dir: Path,
          initial: dict, arrays: tuple[np.ndarray, ...], signature: dict) -> dict:
    """Run the package on ``arrays`` (one epoch, seed 0) within the profile's cores and memory,
    or emulated, and the Python runner on the same batches of the build in ``reference_dir``
    (the device's, or the host's for an emulated CPU); the verdict and both runners' figures.
    Raises if the two do not agree."""
    limits = {"cores": int(profile.cores), "memory_mb": int(profile.memory_mb)}
    arch = packageable(profile)
    emulated = runs_here(arch) is not None
    if emulated and not (profile.emulation and root_is_ready(emulation_root(profile))):
        return {"verdict": "not_run", "reason": runs_here(arch), **limits}
    timeout = profile.docker.timeout_s if profile.docker else 900.0
    with tempfile.TemporaryDirectory() as tmp:
        data, native, python = (Path(tmp, name) for name in ("data", "native", "python"))
        for directory in (data, native, python):
            directory.mkdir()
        save_data(data / "train.safetensors", signature, arrays)
        if emulated:  # the device's CPU under qemu, its runner and build
            step_dir = step_directory(build_dir, initial, Path(tmp, "step"))
            run_native(runner_dir / "runner", step_dir, data, native, profile, (), timeout)
        else:
            try:
                run_limited(engine(), image["id"], [], profile,
                            {data: ("/data", "ro"), native: ("/out", "rw")}, timeout)
            except OutOfMemory:
                return {"verdict": "out_of_memory", **limits}
        reference = step_directory(reference_dir, initial, Path(tmp, "reference"))
        python_log = run_python(reference, data, python, limits["cores"], timeout)
        native_log = json.loads((native / "log.json").read_text())
        agree = agreement(native, python, reference)
    if not agree["matches_python"]:
        raise RuntimeError(f"package@{profile.name}: the native runner's losses "
                           f"{native_log['losses']} and weights do not agree with the Python "
                           f"runner's {python_log['losses']} on the same batches ({agree})")
    return {"verdict": "ok", "where": "emulated" if emulated else "container", **limits,
            "steps": native_log["steps"], "batch_size": signature["data_types"][
                signature["data"][0]]["shape"][0],
            "first_loss": native_log["losses"][0], "last_loss": native_log["losses"][-1],
            **agree, "reference_build": "host" if emulated else "device",
            "native": {**figures(native_log), "image_bytes": image["bytes"]},
            # the Python runner here, on this machine's CPU; its image would have held
            # Debian's python3 and the TVM and numpy wheels (images.runtime_layers)
            "python": {**figures(python_log), "image_bytes": sum(
                p.stat().st_size for p in runtime_layers(arch))}}


def trial_data(signature: dict, seed: int, batches: int) -> tuple[np.ndarray, ...]:
    """Seeded data of the step's shapes (step.synthetic_batch), its labels drawn over the
    model's classes: labels all of one class drive the loss to 0 in a few steps, after which
    the trial would compare steps that change nothing."""
    arrays = list(synthetic_batch(signature, seed, batches))
    classes = (signature.get("labels") or {}).get("classes")
    if classes and "labels" in signature["data"]:
        at = signature["data"].index("labels")
        arrays[at] = np.random.default_rng(seed).integers(
            0, classes, arrays[at].shape).astype(arrays[at].dtype)
    return tuple(arrays)


def package(name: str, device: str, profile, build_dir: Path, reference_dir: Path,
            initial: dict, trial_steps: int, seed: int, out_dir: Path) -> dict:
    """The image of case ``name`` for ``device`` (runner/, app.tar and image.json in
    ``out_dir``, the image loaded in the engine), tried on ``trial_steps`` batches of seeded
    data of the step's shapes; the metrics. ``reference_dir`` is the host's build of the case,
    the reference of an emulated trial."""
    signature = json.loads((build_dir / "signature.json").read_text())
    batch = signature["data_types"][signature["data"][0]]["shape"][0]
    about = {"case": name, "scheme": signature["scheme"], "device": device,
             "batch_size": batch, "data": data_inputs(signature)}
    image = make_package(device, profile, build_dir, initial, about, out_dir)
    arrays = trial_data(signature, seed, trial_steps)
    result = trial(image, profile, out_dir / "runner", build_dir,
                   build_dir if runs_here(packageable(profile)) is None else reference_dir,
                   initial, arrays, signature)
    return {"case": name, "device": device, "image": image["tag"], "run": image["run"],
            "trial": result}
