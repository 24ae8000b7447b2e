"""package@device: a runnable Docker image that fine-tunes the model on the device.

Usage: python -m stages.package <device>   (devices in ``package.devices``)
The image is the runtime (minimal Debian for the device's architecture, TVM and numpy:
pipelines/images.py) plus an application layer, /app:
- step.so and signature.json: the device's build of the compiled, sparse training step;
- state.npz: the weights it starts from (the pre-trained model) and the optimizer state (zero);
- package.json: model, scheme, device, batch size and the shapes the step takes;
- finetune.py: the entrypoint (stages/package/entrypoint.py).
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
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from pipelines.artifacts import ARTIFACTS, atomic_dir, save_arrays, write_json_atomic
from pipelines.backends import OPENBLAS_LIB
from pipelines.config import ConfigError, load_params, require, resolved_profile, run_stage
from pipelines.images import (OutOfMemory, add_tree, engine, ensure_image, packageable,
                              run_limited, runs_here, runtime_layers)
from pipelines.ir import dtype_of, load_ir, shape_of
from pipelines.step import CompiledStep, initial_state, load_initial
from stages.package.entrypoint import epoch_batches

ENTRYPOINT = Path(__file__).with_name("entrypoint.py")
OPTIMIZE = ARTIFACTS / "optimize" / "train_step.json"
INITIAL = ARTIFACTS / "lower" / "params.npz"
DATA = ARTIFACTS / "data" / "digits.npz"


def step_inputs(optimized: Path) -> dict:
    """Shape and dtype of the step's data arguments (x, y), from the optimized IR."""
    x, y = load_ir(optimized)["train_step"].params[:2]
    return {name: {"shape": shape_of(p), "dtype": dtype_of(p)} for name, p in (("x", x), ("y", y))}


def app_layer(build_dir: Path, initial: dict, about: dict, path: Path) -> None:
    """The /app layer as a reproducible tar at ``path``."""
    signature = json.loads((build_dir / "signature.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp)
        files = [(build_dir / "step.so", "step.so"),
                 (build_dir / "signature.json", "signature.json"), (ENTRYPOINT, "finetune.py")]
        if (build_dir / OPENBLAS_LIB).exists():  # the step's matrix products call it
            files.append((build_dir / OPENBLAS_LIB, OPENBLAS_LIB))
        for source, name in files:
            shutil.copyfile(source, app / name)
        save_arrays(app / "state.npz", initial_state(signature, initial))
        write_json_atomic(app / "package.json", about)
        for file in app.iterdir():
            file.chmod(0o644)
        app.chmod(0o755)
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            add_tree(tar, app, "app")


def make_package(device: str, profile: dict, build_dir: Path, initial: dict, about: dict,
                 out_dir: Path) -> dict:
    """app.tar and image.json for ``device`` in ``out_dir``; the image loaded in the engine."""
    arch = packageable(profile)
    client = engine()
    app_layer(build_dir, initial, about, out_dir / "app.tar")
    repository = f"pockengine/{about['model']}-{about['scheme']}-{device}".lower()
    image = ensure_image(client, arch, [*runtime_layers(arch), out_dir / "app.tar"],
                         {"Entrypoint": ["python3", "/app/finetune.py"], "WorkingDir": "/app"},
                         repository)
    image["run"] = (f"docker run --rm --network none -v $PWD/data:/data:ro -v $PWD/out:/out "
                    f"{image['tag']} --epochs 1")
    write_json_atomic(out_dir / "image.json", {**about, "image": image})
    return image


def trial(image: dict, profile: dict, build_dir: Path, initial: dict, x: np.ndarray,
          y: np.ndarray, batch: int) -> dict:
    """Run the image as shipped (one epoch, seed 0) on x, y within the profile's cores and
    memory; the verdict and figures. Raises if its losses are not the build's here."""
    limits = {"cores": int(profile["cores"]), "memory_mb": int(profile["memory_mb"])}
    why = runs_here(packageable(profile))
    if why:
        return {"verdict": "not_run", "reason": why, **limits}
    timeout = float((profile.get("docker") or {}).get("timeout_s", 900))
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
        raise RuntimeError(f"package@{profile['name']}: the image's losses {log['losses']} are "
                           f"not the build's here {want} (rtol 1e-5)")
    return {"verdict": "ok", **limits, "steps": log["steps"], "batch_size": batch,
            "ms_per_step": 1000 * log["seconds"] / log["steps"],
            "container_seconds": seconds,  # start, TVM's import, the steps and the writes
            "peak_rss_bytes": log["peak_rss_bytes"],
            "first_loss": log["losses"][0], "last_loss": log["losses"][-1]}


def main(device: str) -> None:
    params = load_params()
    profile = resolved_profile(device)
    model = require(params, "model")
    signature = json.loads((ARTIFACTS / "build" / device / "signature.json").read_text())
    about = {"model": model["name"], "scheme": signature["scheme"], "device": device,
             "batch_size": int(model["batch_size"]), "inputs": step_inputs(OPTIMIZE)}
    if about["inputs"]["y"]["shape"] != [about["batch_size"]]:  # the entrypoint's data format
        raise ConfigError(f"params.yaml: package.devices packages classification steps (one "
                          f"label per example); model.name={model['name']!r} takes y of shape "
                          f"{about['inputs']['y']['shape']}")
    steps = require(params, "package.trial_steps")
    with np.load(DATA) as data:
        x, y = data["finetune_train_x"], data["finetune_train_y"]
    if not isinstance(steps, int) or not 1 <= steps <= len(x) // about["batch_size"]:
        raise ConfigError(f"params.yaml: package.trial_steps={steps!r}; allowed: 1 to "
                          f"{len(x) // about['batch_size']} (batches in the fine-tuning data)")
    examples = steps * about["batch_size"]
    build_dir, initial = ARTIFACTS / "build" / device, load_initial(INITIAL)
    with atomic_dir(ARTIFACTS / "package" / device) as tmp:
        image = make_package(device, profile, build_dir, initial, about, tmp)
        result = trial(image, profile, build_dir, initial, x[:examples], y[:examples],
                       about["batch_size"])
    write_json_atomic(ARTIFACTS / "package" / f"{device}.json",
                      {"device": device, "image": image["tag"], "trial": result})
    print(f"package@{device}: {image['tag']} ({image['id']})\n  {image['run']}\n"
          f"  trial within {result['cores']} cores and {result['memory_mb']} MiB: "
          + (f"ok, {result['steps']} steps at {result['ms_per_step']:.1f} ms, peak "
             f"{result['peak_rss_bytes'] / 2**20:.0f} MiB" if result["verdict"] == "ok"
             else result.get("reason", result["verdict"])))


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
