"""A runnable Docker image that fine-tunes a case's model on a device (package@<case>-<device>).

The image is the runtime (minimal Debian for the device's architecture, TVM and numpy:
pipelines/runtime/images.py) plus an application layer, /app:
- step.so and signature.json: the device's build of the compiled, sparse training step;
- state.npz: the weights it starts from (the pre-trained model) and the optimizer state (zero);
- package.json: model, scheme, device, batch size and the shapes the step takes;
- finetune.py: the entrypoint (pipelines/runtime/package_entrypoint.py).
  docker run --rm --network none -v $PWD/data:/data:ro -v $PWD/out:/out IMAGE --epochs 2
fine-tunes on data/train.npz and writes out/weights.npz (PyTorch names), out/state.npz and
out/log.json.
Outputs (artifacts/package/<device>/): app.tar, the application layer (reproducible bytes), and
image.json: the image ID (a hash of its content), its tag and layers, and how to run it. The
image is loaded into the local Docker engine; an engine without it gets it rebuilt from the
same layers, with the same ID.
Then a trial: the image, run as shipped, fine-tunes on ``package.trial_steps`` batches of the
fine-tuning data in a container limited to the profile's cores and memory (no swap, no network).
Metrics (artifacts/package/<device>.json): its verdict (ok, out_of_memory, or not_run where this
machine cannot run the image's architecture), time per step, peak memory and losses. The losses
must equal the device build's run here on the same batches.
"""
from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from pipelines.io import save_arrays, write_json_atomic
from pipelines.runtime.images import (OutOfMemory, add_tree, engine, ensure_image, packageable,
                                      run_limited, runs_here, runtime_layers)
from pipelines.runtime.device_io import libraries_beside
from pipelines.runtime.package_entrypoint import epoch_batches
from pipelines.runtime.step import CompiledStep, initial_state, synthetic_batch
from pipelines.schema import ConfigError

ENTRYPOINT = Path(__file__).with_name("package_entrypoint.py")
CHECKS = Path(__file__).with_name("checks.py")  # the entrypoint's checks, beside it


def step_inputs(signature: dict, where: str) -> dict:
    """Shape and dtype of the step's data arguments, as the entrypoint's x and y: one input
    and one label per example (what the image's data format holds)."""
    types = [signature["data_types"][name] for name in signature["data"]]
    if len(types) != 2 or types[1]["shape"] != types[0]["shape"][:1]:
        raise ConfigError(f"{where}: a package fine-tunes a classifier of one input (x [N, ...], "
                          f"y [N]); this step takes {signature['data_types']}")
    return dict(zip(("x", "y"), types))


def app_layer(build_dir: Path, initial: dict, about: dict, path: Path) -> None:
    """The /app layer as a reproducible tar at ``path``."""
    signature = json.loads((build_dir / "signature.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp)
        files = [(build_dir / "step.so", "step.so"),
                 (build_dir / "signature.json", "signature.json"), (ENTRYPOINT, "finetune.py"),
                 (CHECKS, "checks.py")]
        # what the step loads beside it (OpenBLAS, where its products run on it)
        files += [(lib, lib.name) for lib in libraries_beside(build_dir / "step.so")]
        for source, name in files:
            shutil.copyfile(source, app / name)
        save_arrays(app / "state.npz", initial_state(signature, initial))
        write_json_atomic(app / "package.json", about)
        for file in app.iterdir():
            file.chmod(0o644)
        app.chmod(0o755)
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            add_tree(tar, app, "app")


def make_package(device: str, profile, build_dir: Path, initial: dict, about: dict,
                 out_dir: Path) -> dict:
    """app.tar and image.json for ``device`` in ``out_dir``; the image loaded in the engine."""
    arch = packageable(profile)
    client = engine()
    app_layer(build_dir, initial, about, out_dir / "app.tar")
    repository = f"pockengine/{about['case']}-{device}".lower()
    image = ensure_image(client, arch, [*runtime_layers(arch), out_dir / "app.tar"],
                         {"Entrypoint": ["python3", "/app/finetune.py"], "WorkingDir": "/app"},
                         repository)
    image["run"] = (f"docker run --rm --network none -v $PWD/data:/data:ro -v $PWD/out:/out "
                    f"{image['tag']} --epochs 1")
    write_json_atomic(out_dir / "image.json", {**about, "image": image})
    return image


def trial(image: dict, profile, build_dir: Path, initial: dict, x: np.ndarray,
          y: np.ndarray, batch: int) -> dict:
    """Run the image as shipped (one epoch, seed 0) on x, y within the profile's cores and
    memory; the verdict and figures. Raises if its losses are not the build's here."""
    limits = {"cores": int(profile.cores), "memory_mb": int(profile.memory_mb)}
    why = runs_here(packageable(profile))
    if why:
        return {"verdict": "not_run", "reason": why, **limits}
    timeout = profile.docker.timeout_s if profile.docker else 900.0
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp, "data"), Path(tmp, "out")
        data.mkdir(), out.mkdir()
        np.savez(data / "train.npz", x=x, y=y)
        start = time.perf_counter()
        try:
            run_limited(engine(), image["id"], [], profile,
                        {data: ("/data", "ro"), out: ("/out", "rw")}, timeout)
        except OutOfMemory:
            return {"verdict": "out_of_memory", **limits}
        seconds = time.perf_counter() - start
        log = json.loads((out / "log.json").read_text())

    local = CompiledStep(build_dir, initial)  # the same batches, in the entrypoint's order
    want = [local.step(x[index], y[index])
            for index in epoch_batches(len(x), batch, np.random.default_rng(0))]
    if not np.allclose(log["losses"], want, rtol=1e-5, atol=0):
        raise RuntimeError(f"package@{profile.name}: the image's losses {log['losses']} are "
                           f"not the build's here {want} (rtol 1e-5)")
    return {"verdict": "ok", **limits, "steps": log["steps"], "batch_size": batch,
            "ms_per_step": 1000 * log["seconds"] / log["steps"],
            "container_seconds": seconds,  # start, TVM's import, the steps and the writes
            "peak_rss_bytes": log["peak_rss_bytes"],
            "first_loss": log["losses"][0], "last_loss": log["losses"][-1]}


def package(name: str, device: str, profile, build_dir: Path, initial: dict,
            trial_steps: int, seed: int, out_dir: Path) -> dict:
    """The image of case ``name`` for ``device`` (app.tar and image.json in ``out_dir``, the
    image loaded in the engine), tried on ``trial_steps`` batches of seeded data of the step's
    shapes; the metrics."""
    signature = json.loads((build_dir / "signature.json").read_text())
    batch = signature["data_types"][signature["data"][0]]["shape"][0]
    about = {"case": name, "scheme": signature["scheme"], "device": device,
             "batch_size": batch,
             "inputs": step_inputs(signature, f"package.devices for case {name!r}")}
    x, y = synthetic_batch(signature, seed, trial_steps)
    image = make_package(device, profile, build_dir, initial, about, out_dir)
    result = trial(image, profile, build_dir, initial, x, y, batch)
    return {"case": name, "device": device, "image": image["tag"], "run": image["run"],
            "trial": result}
