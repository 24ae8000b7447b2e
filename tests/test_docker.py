"""Docker: the runner that limits a device's cores and memory, and the packaged images.

- the mbv2 step (the paper's scheme) built for the edge_x86 profile runs in a container of the
  runtime image and gives the local run's loss and updated weights;
- a profile with too little memory is killed for memory, which the runner reports as such;
- the packaged image fine-tunes on a tiny mounted data directory; its weights load into the
  PyTorch model and equal the local compiled step's after the same steps; the package stage's
  trial runs it within the device's limits (ok, or out of memory);
- layers and image IDs are reproducible; a missing engine and unpackageable devices are named.
The tests that need an engine skip, with the reason, only where none answers (.ci/run starts
one).
"""
import json

import numpy as np
import pytest
import torch
import yaml

from pipelines.config import CONF, ConfigError, load_profile
from pipelines.step import CompiledStep, load_initial
from stages.build.toolchain import compile_step
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "mbv2", "arch": "mobilenetv2", "width": 0.35, "num_classes": 10,
         "in_channels": 3, "image_size": 32, "batch_size": 8}
OPT = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@pytest.fixture(scope="module")
def client():
    from pipelines.images import engine

    try:
        return engine()
    except ConfigError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def step():
    """The mbv2 step with the paper's scheme, and the state it starts from (PyTorch's init)."""
    from pipelines.models import build_model

    layers, full, signature = full_step(MODEL, OPT)
    scheme = yaml.safe_load((CONF / "sparse" / "mbv2_paper.yaml").read_text())
    pruned, sig, _ = sparse_step(full, signature, select(scheme, layers))
    sig = dict(sig, scheme="mbv2_paper")
    torch.manual_seed(0)
    state = build_model(MODEL).state_dict()
    initial = {r: state[t].numpy() for r, t in sig["torch_names"].items()}
    return optimize(pruned, sig, reorder=True), sig, initial


def _build(step, device: str, directory):
    """``directory`` holding the step built for ``device``."""
    mod, sig, _ = step
    compile_step(mod, load_profile(device, {}), directory)
    (directory / "signature.json").write_text(json.dumps(sig))
    return directory


def _batches(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, 32, 32)).astype("float32")
    return x, rng.integers(0, 10, n).astype("int64")


@pytest.fixture(scope="module")
def host_build(step, tmp_path_factory):
    return _build(step, "host", tmp_path_factory.mktemp("host"))


def test_container_step_matches_the_local_run(client, step, tmp_path):
    from stages.benchmark.remote import run_docker

    edge = _build(step, "edge_x86", tmp_path)
    local = CompiledStep(edge, step[2])
    args = local.arguments(*_batches(8))
    want = [o.numpy() for o in local.function(*args)]
    got, times, info = run_docker(edge / "step.so", [a.numpy() for a in args],
                                  load_profile("edge_x86", {}), warmup=1, steps=2)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(times) == 2 and info["image"].startswith("pockengine/runtime-amd64:")
    assert 0 < info["peak_rss_bytes"] < 2048 * 2**20  # inside the profile's memory


def test_too_little_memory_is_reported_as_out_of_memory(client, step, host_build, tmp_path):
    from pipelines.images import OutOfMemory
    from stages.benchmark.remote import run_docker

    local = CompiledStep(host_build, step[2])
    args = [a.numpy() for a in local.arguments(*_batches(8))]
    small = load_profile("edge_x86", {"edge_x86": {"memory_mb": 48}})
    with pytest.raises(OutOfMemory, match="memory_mb=48"):
        run_docker(host_build / "step.so", args, small, warmup=0, steps=1)


ABOUT = {"model": "mbv2", "scheme": "mbv2_paper", "device": "host", "batch_size": 8,
         "inputs": {"x": {"shape": [8, 3, 32, 32], "dtype": "float32"},
                    "y": {"shape": [8], "dtype": "int64"}}}


@pytest.fixture(scope="module")
def package(client, step, host_build, tmp_path_factory):
    from stages.package.__main__ import make_package

    out = tmp_path_factory.mktemp("package")
    return make_package("host", load_profile("host", {}), host_build, step[2], ABOUT, out), out


def _run(client, image: str, args: list, data, out) -> tuple[int, str]:
    container = client.containers.run(
        image, args, detach=True, network_mode="none",
        volumes={str(data): {"bind": "/data", "mode": "ro"}, str(out): {"bind": "/out", "mode": "rw"}})
    try:
        return container.wait()["StatusCode"], container.logs().decode()
    finally:
        container.remove(force=True)


def test_package_is_content_addressed(package, step, host_build, tmp_path):
    from stages.package.__main__ import make_package

    image, out = package
    again = make_package("host", load_profile("host", {}), host_build, step[2], ABOUT, tmp_path)
    assert again["id"] == image["id"]  # same inputs, same image
    assert (tmp_path / "app.tar").read_bytes() == (out / "app.tar").read_bytes()
    assert image["tag"] == f"pockengine/mbv2-mbv2_paper-host:{image['id'][7:19]}"
    assert json.loads((out / "image.json").read_text())["image"]["id"] == image["id"]


def test_packaged_image_fine_tunes_and_its_weights_load_into_pytorch(client, package, step,
                                                                     host_build, tmp_path):
    from pipelines.models import build_model

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(20)  # two batches of 8; the last 4 examples are dropped
    np.savez(data / "train.npz", x=x, y=y)
    code, logs = _run(client, package[0]["id"], ["--epochs", "1", "--seed", "3"], data, out)
    assert code == 0, logs
    log = json.loads((out / "log.json").read_text())

    local = CompiledStep(host_build, step[2])  # the same steps, here
    order = np.random.default_rng(3).permutation(20)
    losses = [local.step(x[order[i:i + 8]], y[order[i:i + 8]]) for i in (0, 8)]
    assert log["losses"] == pytest.approx(losses, rel=1e-6)

    model = build_model(MODEL)
    with np.load(out / "weights.npz") as weights:
        state = {k: torch.from_numpy(weights[k]) for k in weights.files}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    for name, value in local.torch_state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    assert torch.isfinite(model.eval()(torch.from_numpy(x[:2]))).all()


def test_packaged_image_names_bad_data(client, package, tmp_path):
    """A data directory without train.npz, or with the wrong shapes, is named; nothing is
    written."""
    out = tmp_path / "out"
    out.mkdir()
    code, logs = _run(client, package[0]["id"], [], tmp_path, out)
    assert code == 2 and "train.npz: not found" in logs
    np.savez(tmp_path / "train.npz", x=np.zeros((9, 3, 8, 8), "float32"), y=np.zeros(9))
    code, logs = _run(client, package[0]["id"], [], tmp_path, out)
    assert code == 2 and "allowed: x [N, 3, 32, 32] and y [N]" in logs
    assert not list(out.iterdir())


def test_package_trial_runs_within_the_device_limits(package, step, host_build):
    """The stage's trial: the image as shipped fine-tunes within the profile's cores and memory
    and gives the build's losses; too little memory is a verdict, not a failure; an image this
    machine cannot run is said to be not run."""
    from stages.package.__main__ import trial

    x, y = _batches(16)
    result = trial(package[0], load_profile("host", {}), host_build, step[2], x, y, 8)
    assert result["verdict"] == "ok" and result["steps"] == 2
    assert 0 < result["peak_rss_bytes"] < 24576 * 2**20
    assert 0 < result["ms_per_step"] * 2 < 1000 * result["container_seconds"]  # within the run
    small = load_profile("edge_x86", {"edge_x86": {"memory_mb": 48}})
    assert trial(package[0], small, host_build, step[2], x, y, 8) == {
        "verdict": "out_of_memory", "cores": 2, "memory_mb": 48}
    arm = trial(package[0], load_profile("rpi4", {}), host_build, step[2], x, y, 8)
    assert arm["verdict"] == "not_run" and "arm64 image is built, not run" in arm["reason"]


def test_runtime_layers_are_reproducible(client, monkeypatch, tmp_path):
    """Made again from scratch (mmdebstrap, pip), the Debian and Python layers are the same
    bytes as the cached ones the images were built from, wherever the checkout is (pip ran
    under another interpreter path for the cached ones in CI's clean clone)."""
    import pipelines.images as images

    cached = images.runtime_layers("x86_64")
    monkeypatch.setattr(images, "CACHE", tmp_path)
    fresh = images.runtime_layers("x86_64")
    assert [p.name for p in fresh] == [p.name for p in cached]
    assert [images.diff_id(p) for p in fresh] == [images.diff_id(p) for p in cached]


def test_no_engine_says_how_to_start_one(monkeypatch):
    from pipelines.images import engine

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ConfigError, match="dockerd --storage-driver=vfs"):
        engine()


def test_only_cpu_builds_linked_here_are_packaged():
    from pipelines.compose import compose_text
    from pipelines.images import packageable

    assert packageable(load_profile("rpi4", {})) == "aarch64"
    with pytest.raises(ConfigError, match="android_sd8g2.yaml: a container image runs a CPU "
                                          "build linked here"):
        packageable(load_profile("android_sd8g2", {}))
    with pytest.raises(ConfigError, match="package.devices has 'edge_x86', which is not built"):
        compose_text(["devices=[host]", "package.devices=[edge_x86]"])
    with pytest.raises(ConfigError, match="package.trial_steps=0; allowed: an integer >= 1"):
        compose_text(["package.trial_steps=0"])


def test_docker_runner_refuses_another_cpu():
    with pytest.raises(ConfigError, match="runner='docker' runs the build on this machine's CPU"):
        load_profile("rpi4", {"rpi4": {"runner": "docker"}})
