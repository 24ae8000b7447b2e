"""Docker: the runner that limits a device's cores and memory (pipelines/runtime/runners/docker.py,
images.py); the native runner (pipelines/runtime/native.py, native_runner.cc) and the packaged
images that ship it (pipelines/runtime/package.py).

- the mbv2 step (the paper's scheme) built for the edge_x86 profile runs in a container of the
  runtime image and gives the local run's loss (rel 1e-6) and updated weights (rtol 1e-5, atol
  1e-6);
- a profile with too little memory is killed for memory, which the runner reports as such and
  the benchmark stage (pipelines/evaluate/device.py) records as a verdict;
- PyTorch's peers train the same case in the device's container (the PyTorch image; for
  torch.compile, with g++ and the headers): three steps' losses equal eager PyTorch's here
  (rel 1e-5), the trained set the same size; so do the TensorFlow, TFLite, ONNX Runtime and
  ExecuTorch peers (saved or converted here, run by TensorFlow's runtime, LiteRT's interpreter,
  ONNX Runtime's training API or ExecuTorch's runtime in an image of their own); one that is
  killed for memory, or fails, is recorded so, the others still run;
- the native runner and the Python runner give the same batches, losses and weights, bit for
  bit; the native runner names bad data (exit 2) and stops at a non-finite loss (exit 3);
- the packaged image (no Python in it) fine-tunes on a tiny mounted data directory; its losses
  equal the local compiled step's on the same batches (rel 1e-6) and its weights load into the
  PyTorch model and equal the local step's after them (rtol 1e-6, atol 1e-7); the package
  stage's trial runs it within the device's limits beside the Python runner (in 32 MB; an
  image of a CPU neither run nor emulated here is not run);
- layers, runner and image IDs are reproducible; a missing engine and unpackageable devices are
  named.
The tests that need an engine are slow and skip, with the reason, only where none answers
(`pock setup` starts one); those that make the runtime layers need mmdebstrap.
"""
import importlib.util
import io
import json
import tarfile

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


# PyTorch's peers in the container: whether each trains the scheme's frozen layers frozen, and
# its image (torch.compile's has g++ and the headers its kernels compile against)
PYTORCH_PEERS = [("torch_eager_full", False, "pytorch"), ("torch_eager_frozen", True, "pytorch"),
                 ("torch_compile_full", False, "pytorch-compile")]


@pytest.mark.slow
def test_pytorch_peers_train_in_the_container_as_on_the_host(client, params, host_step,
                                                             edge_build):
    """PyTorch's peers in the device's limits do the host's update: three steps' losses within
    1e-5 of eager PyTorch's here (full backpropagation, eager and compiled by torch.compile in
    the container, and the scheme's frozen layers frozen), the first within 1e-4 of the
    compiled step's."""
    from pipelines.evaluate.device import run_on_device
    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import lr_scales_of, make_optimizer, selection_of, train_step
    from pipelines.runtime.step import CompiledStep

    model = params.models[params.cases[CASE].model]
    batch = _batches(8)
    local = CompiledStep(host_step.directory, host_step.initial)
    want = [o.numpy() for o in local.function(*local.arguments(*batch))]
    peers = {"docker": {"peers": [peer for peer, _, _ in PYTORCH_PEERS]}}
    result = run_on_device("edge_x86", load_profile("edge_x86", {"edge_x86": peers}),
                           edge_build, host_step.initial, batch, want, warmup=2, steps=1,
                           model=model, optimizer=OPT)
    signature = host_step.signature
    for peer, frozen, image in PYTORCH_PEERS:
        got = result["peers"][peer]
        assert got["verdict"] == "ok" and got["matches_host"], got
        assert got["image"].startswith(f"pockengine/{image}-amd64:"), peer
        twin = torch_twin(model, signature, host_step.initial, adapters=frozen)
        update = (make_optimizer(twin, OPT, list(selection_of(signature)),
                                 lr_scales_of(signature)) if frozen
                  else make_optimizer(twin, OPT))
        here = [train_step(twin, update, *batch) for _ in range(3)]
        assert got["losses"] == pytest.approx(here, rel=1e-5), peer
        trained = sum(p.numel() for p in twin.parameters() if p.requires_grad)
        assert got["trained_elements"] == trained, peer
        assert got["container"]["steps"] == 1 and 0 < got["peak_rss_bytes"] < 2048 * 2**20
    assert (result["peers"]["torch_eager_frozen"]["trained_elements"]
            < result["peers"]["torch_eager_full"]["trained_elements"])
    # The native runner (what a package ships) ran the same build in the same limits, and the
    # peers are compared with its run: a fraction of the Python runner's memory.
    native = result["native"]
    assert native["verdict"] == "ok" and native["matches"], native
    assert native["image"].startswith("pockengine/native-amd64:") and native["steps"] == 3
    assert 0 < native["peak_rss_bytes"] < result["peak_rss_bytes"] / 2
    assert result["memory_vs_torch_eager_full"] == pytest.approx(
        native["peak_rss_bytes"] / result["peers"]["torch_eager_full"]["peak_rss_bytes"])


# The on-device engines' peers with the scheme's layers frozen: the library each needs here,
# its image, and whether it runs the case's SGD with momentum or plain SGD (ONNX Runtime's).
ENGINE_PEERS = [("tensorflow_frozen", "tensorflow", "tensorflow", False),
                ("tflite_frozen", "ai_edge_litert", "litert", False),
                ("ort_training_frozen", "onnxruntime.training", "onnxruntime", True),
                ("executorch_frozen", "executorch", "executorch", False)]


@pytest.mark.slow
@pytest.mark.parametrize("peer,library,image,plain_sgd", ENGINE_PEERS,
                         ids=[p[0] for p in ENGINE_PEERS])
def test_engine_peers_train_in_the_container_as_pytorch(client, params, host_step, edge_build,
                                                        peer, library, image, plain_sgd):
    """TensorFlow (its step saved here, run by TensorFlow's runtime), TFLite (its model
    converted here, run by LiteRT's interpreter), ONNX Runtime training
    (its artifacts made here, run by its training API) and ExecuTorch training (its program
    made here, run by its runtime), each in the device's container in an image of its own
    runtime, do PyTorch's update with the same layers frozen: three steps' losses within 1e-5,
    the first the compiled step's. (Their full-BP twins share the path; on the host both are
    checked, test_peers.py.)"""
    # found, not imported: TensorFlow's import would load Keras on its backend for the rest of
    # this worker (tests/test_peers.py)
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed: pip install -e '.[peers]'")
    from pipelines.evaluate.device import run_on_device
    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import make_optimizer, selection_of, train_step
    from pipelines.peers.onnxruntime_training import optimizer_run
    from pipelines.runtime.step import CompiledStep

    model = params.models[params.cases[CASE].model]
    batch = _batches(8)
    local = CompiledStep(host_step.directory, host_step.initial)
    want = [o.numpy() for o in local.function(*local.arguments(*batch))]
    peers = {"docker": {"peers": [peer]}}
    result = run_on_device("edge_x86", load_profile("edge_x86", {"edge_x86": peers}),
                           edge_build, host_step.initial, batch, want, warmup=2, steps=1,
                           model=model, optimizer=OPT)
    got = result["peers"][peer]
    assert got["verdict"] == "ok" and got["matches_host"], got
    assert got["image"].startswith(f"pockengine/{image}-amd64:")
    twin = torch_twin(model, host_step.signature, host_step.initial, adapters=True)
    update = make_optimizer(twin, optimizer_run(OPT) if plain_sgd else OPT,
                            list(selection_of(host_step.signature)))
    here = [train_step(twin, update, *batch) for _ in range(3)]
    assert got["losses"] == pytest.approx(here, rel=1e-5)
    assert got["trained_elements"] == sum(p.numel() for p in twin.parameters() if p.requires_grad)
    assert got["container"]["steps"] == 1 and 0 < got["peak_rss_bytes"] < 2048 * 2**20


def test_the_profiles_container_peers_are_those_that_run_in_a_container():
    """docker.peers allows exactly the registered peers evaluate/container_peers.py runs (the
    profile schema cannot import the peers: it sits below them)."""
    from typing import get_args

    from pipelines.evaluate.container_peers import IN_CONTAINER
    from pipelines.peers import PEERS
    from pipelines.runtime.runners.docker import Config

    allowed = set(get_args(get_args(Config.model_fields["peers"].annotation)[0]))
    assert allowed == set(IN_CONTAINER) and allowed <= set(PEERS)


def test_a_peer_out_of_memory_or_failing_is_recorded_and_the_next_runs(monkeypatch):
    """(No container: the kill itself is the runner's, tested above with the compiled step; a
    PyTorch process in a tiny limit can thrash on its library's pages for minutes first.)"""
    from pipelines.evaluate import container_peers
    from pipelines.runtime import runners
    from pipelines.runtime.images import OutOfMemory

    answers = iter([OutOfMemory("killed for memory (exit 137): over memory_mb=8192\nlogs"),
                    RuntimeError("container exited with 1:\nTraceback\nValueError: bad")])

    def run_peer(*args):
        raise next(answers)

    monkeypatch.setattr(container_peers, "export_peer", lambda *args: {})
    monkeypatch.setattr(runners.RUNNERS["docker"], "run_peer", run_peer)
    got = container_peers.run_peers(load_profile("board_8g", {}),
                                    ["torch_eager_full", "torch_eager_frozen"], None, {}, {},
                                    OPT, (), 2.0, 0, 1)
    assert got == {
        "torch_eager_full": {"verdict": "out_of_memory", "memory_mb": 8192,
                             "reason": "killed for memory (exit 137): over memory_mb=8192"},
        "torch_eager_frozen": {"verdict": "failed", "reason": "RuntimeError: container "
                                                              "exited with 1: ... ValueError: bad"}}


def _about(signature: dict) -> dict:
    from pipelines.runtime.package import data_inputs

    return {"case": CASE, "scheme": "mbv2_paper", "device": "host", "batch_size": 8,
            "data": data_inputs(signature)}


@pytest.fixture(scope="module")
def package(client, host_step, tmp_path_factory):
    from pipelines.runtime.package import make_package

    out = tmp_path_factory.mktemp("package")
    image = make_package("host", load_profile("host", {}), host_step.directory,
                         host_step.initial, _about(host_step.signature), out)
    return image, out


@pytest.mark.slow
def test_package_is_content_addressed_and_holds_no_python(client, package, host_step, tmp_path):
    from pipelines.runtime.package import make_package

    image, out = package
    about = _about(host_step.signature)
    assert about["data"] == {"x": {"shape": ["N", 3, 32, 32], "dtype": "float32"},
                             "labels": {"shape": ["N"], "dtype": "int64"}}
    again = make_package("host", load_profile("host", {}), host_step.directory,
                         host_step.initial, about, tmp_path)
    assert again["id"] == image["id"]  # same inputs, same image
    assert (tmp_path / "app.tar").read_bytes() == (out / "app.tar").read_bytes()
    assert (tmp_path / "runner/runner").read_bytes() == (out / "runner/runner").read_bytes()
    assert image["tag"] == f"pockengine/{CASE}-host:{image['id'][7:19]}"
    assert json.loads((out / "image.json").read_text())["image"]["id"] == image["id"]
    files = client.containers.create(image["id"])
    try:  # the image's files: Debian's C++ runtime, the runner, the step
        listing = {m.name for m in tarfile.open(fileobj=io.BytesIO(
            b"".join(files.export())), mode="r")}
    finally:
        files.remove()
    assert "app/runner" in listing and "app/step.so" in listing
    assert not [n for n in listing if "python" in n or n.endswith(".py")]


def _run(client, image: str, args: list, data, out) -> tuple[int, str]:
    container = client.containers.run(
        image, args, detach=True, network_mode="none",
        volumes={str(data): {"bind": "/data", "mode": "ro"}, str(out): {"bind": "/out", "mode": "rw"}})
    try:
        return container.wait()["StatusCode"], container.logs().decode()
    finally:
        container.remove(force=True)


def _save(path, x, y):
    from safetensors.numpy import save_file

    save_file({"x": x, "labels": y}, str(path))


@pytest.mark.slow
def test_packaged_image_fine_tunes_and_its_weights_load_into_pytorch(client, package, params,
                                                                     host_step, tmp_path):
    from safetensors.torch import load_file

    from pipelines.frontends import load_module
    from pipelines.runtime.python_runner import shuffled
    from pipelines.runtime.step import CompiledStep

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(20)  # two batches of 8; the last 4 examples are dropped
    _save(data / "train.safetensors", x, y)
    code, logs = _run(client, package[0]["id"], ["--epochs", "1", "--seed", "3"], data, out)
    assert code == 0, logs
    log = json.loads((out / "log.json").read_text())

    local = CompiledStep(host_step.directory, host_step.initial)  # the same steps, here
    order = shuffled(20, [3])
    assert log["order"] == order[:16]
    losses = [local.step(x[order[i:i + 8]], y[order[i:i + 8]]) for i in (0, 8)]
    assert log["steps"] == 2 and log["losses"] == pytest.approx(losses, rel=1e-6)

    model, _ = load_module(params.models[params.cases[CASE].model])
    state = load_file(str(out / "weights.safetensors"))
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    for name, value in local.state_dict().items():
        np.testing.assert_allclose(state[name].numpy(), value.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    assert torch.isfinite(model.eval()(torch.from_numpy(x[:2]))).all()


@pytest.fixture(scope="module")
def native(host_step, tmp_path_factory):
    """The native runner built for the host, and a step directory of the host build."""
    from pipelines.runtime.native import build_runner, step_directory

    root = tmp_path_factory.mktemp("native")
    runner = build_runner(load_profile("host", {}), root / "runner")
    return runner, step_directory(host_step.directory, host_step.initial, root / "step")


def _native(native, data, out, *args) -> tuple[int, str]:
    import subprocess

    done = subprocess.run([str(native[0]), str(native[1]), "--data", str(data), "--out",
                           str(out), *args], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("frozen_dtype", ["float32", "bfloat16", "int8"])
def test_native_and_python_runners_give_the_same_weights(native, host_step, params, build_case,
                                                         frozen_dtype, tmp_path):
    """The native runner and the Python runner (python_runner.py) on the same step directory
    and data, two epochs: the same batches, losses and weights, bit for bit; the native runner
    in a fraction of the Python runner's memory. Also for a step that stores its frozen
    weights in bfloat16 (safetensors BF16 in its state, which each runner reads itself), or in
    int8 beside their rows' scales, which both write out as stored."""
    import subprocess
    import sys

    from pipelines.io import load_tensors
    from pipelines.runtime.native import PYTHON_RUNNER, step_directory
    from pipelines.stored_weights import STORED_AS, scale_name

    if frozen_dtype != "float32":
        step = build_case(params, CASE, optimizer=OPT, frozen_dtype=frozen_dtype)
        native = (native[0], step_directory(step.directory, step.initial, tmp_path / "step"))
        stored = step.signature[STORED_AS]
        state = load_tensors(native[1] / "state.safetensors")
        assert stored and {n for n, v in state.items() if v.dtype == frozen_dtype} == set(stored)
    data = tmp_path / "data"
    data.mkdir()
    _save(data / "train.safetensors", *_batches(20))
    outs = {name: tmp_path / name for name in ("native", "python")}
    for out in outs.values():
        out.mkdir()
    code, logs = _native(native, data, outs["native"], "--epochs", "2", "--seed", "5")
    assert code == 0, logs
    subprocess.run([sys.executable, str(PYTHON_RUNNER), str(native[1]), "--data", str(data),
                    "--out", str(outs["python"]), "--epochs", "2", "--seed", "5"], check=True)
    logs = {n: json.loads((o / "log.json").read_text()) for n, o in outs.items()}
    assert logs["native"]["steps"] == 4 and logs["native"]["order"] == logs["python"]["order"]
    assert np.array_equal(np.float32(logs["native"]["losses"]), np.float32(logs["python"]["losses"]))
    for file in ("weights", "state"):
        got, want = (load_tensors(o / f"{file}.safetensors") for o in outs.values())
        assert sorted(got) == sorted(want)
        for name in want:
            assert np.array_equal(got[name], want[name]), name
    if frozen_dtype == "int8":
        names = step.signature["source_names"]
        weights = load_tensors(outs["native"] / "weights.safetensors")
        assert all(weights[names[n]].dtype == np.int8 and scale_name(names[n]) in weights
                   for n in stored)
    assert 0 < logs["native"]["peak_rss_bytes"] < logs["python"]["peak_rss_bytes"]


@pytest.mark.slow
def test_native_runner_names_bad_data(native, tmp_path):
    """A data directory without train.safetensors, with the wrong shapes, with labels the
    model's 10 classes do not have, or with NaN in x, or a state of another shape, is named
    with exit code 2; nothing is written."""
    out = tmp_path / "out"
    out.mkdir()
    code, logs = _native(native, tmp_path, out)
    assert code == 2 and "train.safetensors: not found" in logs
    _save(tmp_path / "train.safetensors", np.zeros((9, 3, 8, 8), "float32"), np.zeros(9, "int64"))
    code, logs = _native(native, tmp_path, out)
    assert code == 2 and ("tensor 'x' is float32 [9, 3, 8, 8]; allowed: x float32 "
                          "[N, 3, 32, 32] and labels int64 [N]") in logs, logs
    x, y = _batches(16)
    for label in (10, -5, 10**9):
        bad = y.copy()
        bad[3] = label
        _save(tmp_path / "train.safetensors", x, bad)
        code, logs = _native(native, tmp_path, out)
        assert code == 2 and f"labels [{label}] are out of range; allowed: 0 to 9" in logs
    nan = x.copy()
    nan[2, 0, 0, 0] = np.nan
    _save(tmp_path / "train.safetensors", nan, y)
    code, logs = _native(native, tmp_path, out)
    assert code == 2 and "holds 1 non-finite values" in logs
    # the state is checked once, as the built step does not check its inputs
    from safetensors.numpy import load_file, save_file

    _save(tmp_path / "train.safetensors", x, y)
    state = load_file(str(native[1] / "state.safetensors"))
    name = next(n for n in sorted(state) if state[n].ndim > 1)
    save_file({**state, name: state[name].ravel()}, str(tmp_path / "state.safetensors"))
    code, logs = _native(native, tmp_path, out, "--state", str(tmp_path / "state.safetensors"))
    assert code == 2 and (f"state.safetensors: tensor '{name}' is float32 "
                          f"[{state[name].size}]; allowed: float32 "
                          f"{list(state[name].shape)}") in logs, logs
    assert not list(out.iterdir())


@pytest.mark.slow
def test_both_runners_refuse_an_index_past_its_table(native, tmp_path):
    """An input whose runner.json entry has ``rows`` (one that indexes a table: token ids,
    analysis/indices.py) holds values in [0, rows) or is refused with exit code 2 by the native
    and the Python runner alike; nothing is written. Here the labels stand in for such an
    input: a table of 7 rows refuses the classes 7 to 9 they may hold."""
    import shutil
    import subprocess
    import sys

    from pipelines.runtime.native import PYTHON_RUNNER

    step = tmp_path / "step"
    shutil.copytree(native[1], step)
    manifest = json.loads((step / "runner.json").read_text())
    manifest["data"] = [d | {"rows": 7} if d["name"] == "labels" else d for d in manifest["data"]]
    (step / "runner.json").write_text(json.dumps(manifest))
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(16)
    y = y % 7
    y[5] = 8
    _save(data / "train.safetensors", x, y)
    native_run = subprocess.run([str(native[0]), str(step), "--data", str(data), "--out",
                                 str(out)], capture_output=True, text=True)
    python_run = subprocess.run([sys.executable, str(PYTHON_RUNNER), str(step), "--data",
                                 str(data), "--out", str(out)], capture_output=True, text=True)
    for done in (native_run, python_run):
        assert done.returncode == 2, done.stderr
        assert "input 'labels' holds [8], past the table it indexes; allowed: 0 to 6" in (
            done.stdout + done.stderr)
    assert not list(out.iterdir())


@pytest.mark.slow
def test_native_runner_stops_at_a_step_that_goes_nan(native, host_step, tmp_path):
    """From a state whose classifier weight holds NaN (passed as --state), the first step's
    loss is NaN: exit code 3 naming the step, and no weights written as if it had succeeded."""
    from safetensors.numpy import save_file

    from pipelines.runtime.step import initial_state

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir(), out.mkdir()
    x, y = _batches(16)
    _save(data / "train.safetensors", x, y)
    signature = host_step.signature
    state = initial_state(signature, host_step.initial)
    head = next(n for n, s in signature["source_names"].items() if s == "classifier.1.weight")
    state[head][0, 0] = np.nan
    save_file(state, str(data / "state.safetensors"))
    code, logs = _native(native, data, out, "--state", str(data / "state.safetensors"))
    assert code == 3 and "step 1: its loss is not finite" in logs, logs
    assert not list(out.iterdir())


@pytest.mark.slow
def test_package_trial_runs_within_the_device_limits(package, host_step):
    """The stage's trial: the image as shipped fine-tunes within the profile's cores and memory
    and agrees with the Python runner on the same batches, bit for bit, in 32 MB; a device whose
    CPU this machine neither runs nor emulates is said to be not run."""
    from pipelines.runtime.package import trial
    from pipelines.runtime.step import synthetic_batch

    build, initial = host_step.directory, host_step.initial
    arrays = synthetic_batch(host_step.signature, 0, 2)
    run = (package[0], load_profile("host", {}), package[1] / "runner", build, build, initial,
           arrays)
    result = trial(*run, host_step.signature)
    assert result["verdict"] == "ok" and result["where"] == "container" and result["steps"] == 2
    assert result["matches_python"] and result["bit_identical"]
    native, python = result["native"], result["python"]
    assert 0 < native["peak_rss_bytes"] < python["peak_rss_bytes"]
    assert 0 < native["image_bytes"] < python["image_bytes"]
    assert 0 < native["ms_per_step"] < 1000 * native["seconds"]  # within the run
    # 32 MB: the runner's peak RSS is ~19 MB, of which the files it maps (the libraries, the
    # data) are reclaimable; it has run in Docker's least limit, 6 MB, but not reliably with
    # the other core busy. The Python runner peaks at ~420 MB.
    small = load_profile("edge_x86", {"edge_x86": {"memory_mb": 32}})
    assert trial(run[0], small, *run[2:], host_step.signature)["verdict"] == "ok"
    arm = load_profile("rpi4", {"rpi4": {"emulation": {"root": "/nonexistent"}}})
    result = trial(run[0], arm, *run[2:], host_step.signature)
    assert result["verdict"] == "not_run" and "arm64 image is built, not run" in result["reason"]
