"""Docker: the runner that limits a device's cores and memory (pipelines/runtime/remote.py,
images.py), and the packaged images (pipelines/runtime/package.py, with the entrypoint
pipelines/runtime/package_entrypoint.py).

- the mbv2 step (the paper's scheme) built for the edge_x86 profile runs in a container of the
  runtime image and gives the local run's loss (rel 1e-6) and updated weights (rtol 1e-5, atol
  1e-6);
- a profile with too little memory is killed for memory, which the runner reports as such and
  the benchmark stage (pipelines/evaluate/device.py) records as a verdict;
- the packaged image fine-tunes on a tiny mounted data directory; its losses equal the local
  compiled step's on the same batches (rel 1e-6) and its weights load into the PyTorch model and
  equal the local step's after them (rtol 1e-6, atol 1e-7); the package stage's trial runs it
  within the device's limits (ok, or out of memory; an image of another architecture is not
  run);
- layers and image IDs are reproducible; a missing engine and unpackageable devices are named.
The tests that need an engine are slow and skip, with the reason, only where none answers
(`pock setup` starts one); those that make the runtime layers need mmdebstrap.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from pipelines.config import SGD
from pipelines.profiles import load_profile
from pipelines.schema import ConfigError

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9)
CASE = "mbv2"  # the default experiment's: mbv2 with the paper's scheme


@pytest.fixture(scope="module")
def client():
    from pipelines.runtime.images import engine

    try:
        return engine()
    except ConfigError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def host_step(params, build_case):
    """The mbv2 step with the paper's scheme built for the host, starting from the model's
    seeded initial weights."""
    return build_case(params, CASE, optimizer=OPT)


@pytest.fixture(scope="module")
def edge_build(params, host_step, tmp_path_factory):
    """The same step built for the edge_x86 profile (its own CPU, in a container here)."""
    from pipelines.compile import compile

    spec = params.cases[CASE]
    profile = load_profile("edge_x86", {})
    directory = tmp_path_factory.mktemp("edge_x86")
    compiled = compile(params.models[spec.model], params.schemes[spec.scheme].rules, OPT, profile,
                       directory, scheme_name=spec.scheme)
    for name, value in compiled.initial.items():  # the same seeded start as the host's
        np.testing.assert_array_equal(value, host_step.initial[name])
    return directory


def _batches(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, 32, 32)).astype("float32")
    return x, rng.integers(0, 10, n).astype("int64")


@pytest.mark.slow
def test_container_step_matches_the_local_run(client, host_step, edge_build):
    from pipelines.runtime.runners.docker import run as run_docker
    from pipelines.runtime.step import CompiledStep

    local = CompiledStep(edge_build, host_step.initial)
    args = local.arguments(*_batches(8))
    arrays = [a.numpy() for a in args]  # before the step, which updates its state in place
    want = [o.numpy() for o in local.function(*args)]
    got, times, info = run_docker(edge_build / "step.so", arrays, load_profile("edge_x86", {}),
                                  warmup=1, steps=2)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(times) == 2 and info["image"].startswith("pockengine/runtime-amd64:")
    assert 0 < info["peak_rss_bytes"] < 2048 * 2**20  # inside the profile's memory


@pytest.mark.slow
def test_too_little_memory_is_reported_as_out_of_memory(client, host_step, edge_build):
    from pipelines.evaluate.device import run_on_device
    from pipelines.runtime.images import OutOfMemory
    from pipelines.runtime.runners.docker import run as run_docker
    from pipelines.runtime.step import CompiledStep

    local = CompiledStep(host_step.directory, host_step.initial)
    args = local.arguments(*_batches(8))
    want = [o.numpy() for o in local.function(*args)]
    small = load_profile("edge_x86", {"edge_x86": {"memory_mb": 48}})
    with pytest.raises(OutOfMemory, match="memory_mb=48"):
        run_docker(host_step.directory / "step.so", [a.numpy() for a in args], small,
                   warmup=0, steps=1)
    # the benchmark stage records it as the device's answer, not a failure
    result = run_on_device("edge_x86", small, edge_build, host_step.initial, _batches(8), want,
                           warmup=0, steps=1)
    assert result["ran"] and result["verdict"] == "out_of_memory"
    assert result["memory_mb"] == 48 and "memory_mb=48" in result["reason"]


def _about(signature: dict) -> dict:
    from pipelines.runtime.package import step_inputs

    return {"case": CASE, "scheme": "mbv2_paper", "device": "host", "batch_size": 8,
            "inputs": step_inputs(signature, "test")}


@pytest.fixture(scope="module")
def package(client, host_step, tmp_path_factory):
    from pipelines.runtime.package import make_package

    out = tmp_path_factory.mktemp("package")
    image = make_package("host", load_profile("host", {}), host_step.directory,
                         host_step.initial, _about(host_step.signature), out)
    return image, out


@pytest.mark.slow
def test_package_is_content_addressed(package, host_step, tmp_path):
    from pipelines.runtime.package import make_package

    image, out = package
    about = _about(host_step.signature)
    assert about["inputs"] == {"x": {"shape": [8, 3, 32, 32], "dtype": "float32"},
                               "y": {"shape": [8], "dtype": "int64"}}
    again = make_package("host", load_profile("host", {}), host_step.directory,
                         host_step.initial, about, tmp_path)
    assert again["id"] == image["id"]  # same inputs, same image
    assert (tmp_path / "app.tar").read_bytes() == (out / "app.tar").read_bytes()
    assert image["tag"] == f"pockengine/{CASE}-host:{image['id'][7:19]}"
    assert json.loads((out / "image.json").read_text())["image"]["id"] == image["id"]


def _run(client, image: str, args: list, data, out) -> tuple[int, str]:
    container = client.containers.run(
        image, args, detach=True, network_mode="none",
        volumes={str(data): {"bind": "/data", "mode": "ro"}, str(out): {"bind": "/out", "mode": "rw"}})
    try:
        return container.wait()["StatusCode"], container.logs().decode()
    finally:
        container.remove(force=True)


@pytest.mark.slow
def test_packaged_image_fine_tunes_and_its_weights_load_into_pytorch(client, package, params,
                                                                     host_step, tmp_path):
    from pipelines.frontends import load_module
    from pipelines.runtime.step import CompiledStep

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(20)  # two batches of 8; the last 4 examples are dropped
    np.savez(data / "train.npz", x=x, y=y)
    code, logs = _run(client, package[0]["id"], ["--epochs", "1", "--seed", "3"], data, out)
    assert code == 0, logs
    log = json.loads((out / "log.json").read_text())

    local = CompiledStep(host_step.directory, host_step.initial)  # the same steps, here
    order = np.random.default_rng(3).permutation(20)
    losses = [local.step(x[order[i:i + 8]], y[order[i:i + 8]]) for i in (0, 8)]
    assert log["steps"] == 2 and log["losses"] == pytest.approx(losses, rel=1e-6)

    model, _ = load_module(params.models[params.cases[CASE].model])
    with np.load(out / "weights.npz") as weights:
        state = {k: torch.from_numpy(weights[k]) for k in weights.files}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    for name, value in local.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    assert torch.isfinite(model.eval()(torch.from_numpy(x[:2]))).all()


@pytest.mark.slow
def test_packaged_image_names_bad_data(client, package, tmp_path):
    """A data directory without train.npz, with the wrong shapes, with labels the model's 10
    classes do not have, or with NaN in x, is named with exit code 2; nothing is written."""
    out = tmp_path / "out"
    out.mkdir()
    code, logs = _run(client, package[0]["id"], [], tmp_path, out)
    assert code == 2 and "train.npz: not found" in logs
    np.savez(tmp_path / "train.npz", x=np.zeros((9, 3, 8, 8), "float32"), y=np.zeros(9))
    code, logs = _run(client, package[0]["id"], [], tmp_path, out)
    assert code == 2 and "allowed: x [N, 3, 32, 32] and y [N]" in logs
    x, y = _batches(16)
    for label in (10, -5, 10**9):
        bad = y.copy()
        bad[3] = label
        np.savez(tmp_path / "train.npz", x=x, y=bad)
        code, logs = _run(client, package[0]["id"], [], tmp_path, out)
        assert code == 2 and f"labels [{label}] are out of range; allowed: 0 to 9" in logs
    nan = x.copy()
    nan[2, 0, 0, 0] = np.nan
    np.savez(tmp_path / "train.npz", x=nan, y=y)
    code, logs = _run(client, package[0]["id"], [], tmp_path, out)
    assert code == 2 and "holds 1 non-finite values" in logs
    assert not list(out.iterdir())


@pytest.mark.slow
def test_packaged_image_stops_at_a_step_that_goes_nan(client, package, host_step, tmp_path):
    """From a state whose classifier weight holds NaN (passed as --state), the first step's
    loss is NaN: exit code 3 naming the step, and nothing written as if it had succeeded."""
    from pipelines.runtime.step import initial_state

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(16)
    np.savez(data / "train.npz", x=x, y=y)
    signature = host_step.signature
    state = initial_state(signature, host_step.initial)
    head = next(n for n, s in signature["source_names"].items() if s == "classifier.1.weight")
    state[head][0, 0] = np.nan
    np.savez(data / "state.npz", **state)
    code, logs = _run(client, package[0]["id"], ["--state", "/data/state.npz"], data, out)
    assert code == 3 and "step 1: its loss is not finite" in logs, logs
    assert not list(out.iterdir())


@pytest.mark.slow
def test_package_trial_runs_within_the_device_limits(package, host_step):
    """The stage's trial: the image as shipped fine-tunes within the profile's cores and memory
    and gives the build's losses; too little memory is a verdict, not a failure; an image this
    machine cannot run is said to be not run."""
    from pipelines.runtime.package import trial

    x, y = _batches(16)
    build, initial = host_step.directory, host_step.initial
    result = trial(package[0], load_profile("host", {}), build, initial, x, y, 8)
    assert result["verdict"] == "ok" and result["steps"] == 2
    assert 0 < result["peak_rss_bytes"] < 24576 * 2**20
    assert 0 < result["ms_per_step"] * 2 < 1000 * result["container_seconds"]  # within the run
    small = load_profile("edge_x86", {"edge_x86": {"memory_mb": 48}})
    assert trial(package[0], small, build, initial, x, y, 8) == {
        "verdict": "out_of_memory", "cores": 2, "memory_mb": 48}
    arm = trial(package[0], load_profile("rpi4", {}), build, initial, x, y, 8)
    assert arm["verdict"] == "not_run" and "arm64 image is built, not run" in arm["reason"]


@pytest.mark.slow
def test_package_stage_makes_the_same_image_and_tries_it(client, package, host_step, tmp_path):
    """package@<case>-<device>'s function: the image (the same ID for the same build and
    start), tried on ``trial_steps`` seeded batches of the step's shapes."""
    from pipelines.runtime.package import package as package_case

    metrics = package_case(CASE, "host", load_profile("host", {}), host_step.directory,
                           host_step.initial, 2, 0, tmp_path)
    assert metrics["image"] == package[0]["tag"] and package[0]["tag"] in metrics["run"]
    assert metrics["trial"]["verdict"] == "ok" and metrics["trial"]["steps"] == 2


@pytest.mark.slow
def test_runtime_layers_are_reproducible(monkeypatch, tmp_path):
    """Made again from scratch (mmdebstrap, pip), the Debian and Python layers are the same
    bytes as the cached ones the images were built from, wherever the checkout is (pip ran
    under another interpreter path for the cached ones in CI's clean clone)."""
    from pipelines.runtime import images

    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap not on PATH (Debian package mmdebstrap; `pock setup` installs it)")
    cached = images.runtime_layers("x86_64")
    monkeypatch.setattr(images, "CACHE", tmp_path)
    fresh = images.runtime_layers("x86_64")
    assert [p.parent for p in fresh] == [tmp_path, tmp_path]
    assert [p.name for p in fresh] == [p.name for p in cached]
    assert [images.diff_id(p) for p in fresh] == [images.diff_id(p) for p in cached]


def test_no_engine_says_how_to_start_one(monkeypatch):
    from pipelines.runtime.images import engine

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(ConfigError, match="no Docker engine answers .*dockerd "
                                          "--storage-driver=vfs"):
        engine()


def test_only_cpu_builds_linked_here_are_packaged():
    from pipelines.compose import compose_text
    from pipelines.runtime.images import packageable

    assert packageable(load_profile("rpi4", {})) == "aarch64"
    assert packageable(load_profile("edge_x86", {})) == "x86_64"
    with pytest.raises(ConfigError, match="android_sd8g2.yaml: a container image runs a CPU "
                                          "build linked here"):
        packageable(load_profile("android_sd8g2", {}))
    with pytest.raises(ConfigError, match="jetson_orin.yaml: a container image runs a CPU "
                                          "build linked here .* target kind 'cuda'"):
        packageable(load_profile("jetson_orin", {}))
    with pytest.raises(ConfigError, match=r"package.devices has 'edge_x86', which is not built; "
                                          r"allowed: \['host'\]"):
        compose_text(["devices=[]", "package.devices=[edge_x86]"])
    with pytest.raises(ConfigError, match="android_sd8g2.yaml: a container image"):
        compose_text(["package.devices=[host,android_sd8g2]"])
    with pytest.raises(ConfigError, match=r"params\.yaml: package\.trial_steps=0 \(from "
                                          r"conf/config\.yaml\): Input should be greater than 0"):
        compose_text(["package.trial_steps=0"])


def test_docker_runner_refuses_another_cpu():
    with pytest.raises(ConfigError, match="rpi4.yaml with profiles.rpi4 from params.yaml: "
                                          "runner='docker' runs the build on this machine's CPU"):
        load_profile("rpi4", {"rpi4": {"runner": "docker"}})
