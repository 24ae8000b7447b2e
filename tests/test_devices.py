"""Device profiles, cross-compiled builds and the runners that reach devices.

- every shipped profile resolves (pipelines/profiles.py); a board is added by configuration
  only (a YAML file that extends another, or Hydra overrides), and bad profiles and device lists
  are refused naming file, key and allowed values;
- one small step (a 2-block LLaMA-style decoder, the paper's transformer scheme) built through
  the chain (pipelines/compile.py: build) for: rpi4 (aarch64 ELF, linked by Debian's cross
  g++), apple_m1 (an archive of Mach-O objects the Mac links, reproducible bytes), jetson_orin
  (CUDA kernels compiled by nvcc into a fatbin), Android's Adreno GPU (OpenCL kernels beside
  aarch64 objects); a missing cross compiler is named with its package before anything is
  written;
- the emulated runner (qemu user mode, pipelines/runtime/runners/emulated.py) runs the aarch64 build and
  gets the host build's loss (rel 1e-5) and updated weights (rtol 1e-4, atol 1e-5); the RPC
  runner does the same through a tracker and server on loopback that the test starts and stops;
  a missing tracker, key, qemu or root is named at once. The benchmark stage's
  run_on_device (pipelines/evaluate/device.py) checks a local build against the host's and says
  why a runner of none did not run;
- the scripts that run a step off this process read its peak memory by sampling the resident
  size (pipelines/runtime/sampled_peak.py): 256 MiB held between two reads and freed before
  the end is in the figure.

Building the step, qemu and RPC take tens of seconds: those tests are slow. The emulated run
skips, saying why, only where qemu or the emulation root is absent (`pock setup` makes them);
the cross builds skip only where their compiler is absent.
"""
import json
import shutil
import socket
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
import yaml
from conftest import compose_params

from pipelines import profiles
from pipelines.compose import compose_text
from pipelines.ir import signature_of
from pipelines.config import SGD
from pipelines.profiles import load_profile, tvm_target
from pipelines.schema import ConfigError

SIZE = {"vocab": 64, "dim": 32, "layers": 2, "heads": 2, "hidden": 48, "seq_len": 16}
OPT = SGD(kind="sgd", lr=0.5, momentum=0.9)
SHIPPED = ["host", "rpi4", "jetson_orin", "android_sd8g2", "apple_m1", "edge_x86"]


# --- profiles -----------------------------------------------------------------------------

def test_every_profile_resolves_to_a_tvm_target():
    assert set(SHIPPED) <= set(profiles.available_profiles())
    for name in profiles.available_profiles():
        profile = load_profile(name, {})
        assert profile.name == name
        assert tvm_target(profile).kind.name in ("llvm", "cuda")


def test_a_board_from_hydra_overrides_only():
    text = compose_text(["devices=[rpi5]", "package.devices=[host]", "+profiles.rpi5.extends=rpi4",
                         "+profiles.rpi5.target.mcpu=cortex-a76", "+profiles.rpi5.memory_mb=8192"])
    params = yaml.safe_load(text)
    assert params["devices"] == ["rpi5"]
    rpi5 = load_profile("rpi5", params["profiles"])
    rpi4 = load_profile("rpi4", {})
    assert rpi5.target == dict(rpi4.target, mcpu="cortex-a76")
    assert rpi5.memory_mb == 8192 and rpi5.toolchain == rpi4.toolchain
    # the board's own, not the Pi 4's: its description, its RPC key, and a budget that keeps
    # the Pi 4's share of its memory (2048 of 4096 MiB: 4096 of 8192)
    assert rpi5.description.startswith("rpi5, derived from rpi4")
    assert rpi5.remote.key == "rpi5" and rpi5.remote.tracker == rpi4.remote.tracker
    assert rpi5.memory_budget_mb == 4096
    origins = profiles.profile_origins("rpi5", params["profiles"])
    assert origins["memory_budget_mb"].startswith("derived: rpi4's share of memory")
    assert origins["cores"] == "device_profiles/rpi4.yaml (inherited from rpi4)"
    assert origins["target"] == "params.yaml profiles.rpi5, merged over rpi4's"
    assert "rpi5" in profiles.available_profiles(params["profiles"])
    # An override of a base reaches the boards derived from it.
    assert load_profile("rpi5", {**params["profiles"], "rpi4": {"cores": 2}}).cores == 2


def test_a_board_from_a_new_yaml_file(tmp_path, monkeypatch):
    for name in SHIPPED:
        shutil.copy(profiles.PROFILES / f"{name}.yaml", tmp_path)
    (tmp_path / "orin_nano.yaml").write_text(
        "extends: jetson_orin\ndescription: Jetson Orin Nano 8GB\ncores: 6\nmemory_mb: 8192\n"
        "memory_budget_mb: 4096\n")
    monkeypatch.setattr(profiles, "PROFILES", tmp_path)
    nano = load_profile("orin_nano", {})
    assert nano.target["arch"] == "sm_87" and nano.cores == 6
    assert nano.host == load_profile("jetson_orin", {}).host
    # what the file says is the board's own; its RPC key is its name, not the AGX's
    assert nano.description == "Jetson Orin Nano 8GB" and nano.memory_budget_mb == 4096
    assert nano.remote.key == "orin_nano"
    assert "orin_nano" in profiles.available_profiles()


@pytest.mark.parametrize("override, message", [
    ({"runner": "ssh"}, "runner='ssh': Input should be 'local', 'rpc', 'emulated', 'docker' or "
                        "'none'"),
    ({"toolchain": {"output": "zip"}}, "toolchain.output='zip': Input should be 'shared' or "),
    ({"speed": 3}, "unknown keys ['speed']; allowed: ['cores', "),
    ({"runner": "rpc", "remote": {"tracker": "somewhere", "key": "k"}},
     "remote.tracker='somewhere': allowed: HOST:PORT"),
    ({"runner": "rpc", "remote": None}, "runner 'rpc' needs the section 'remote' with ['key', "),
    ({"runner": "local", "toolchain": {"output": "archive"}}, "allowed with an archive"),
    ({"memory_mb": -1}, "memory_mb=-1: Input should be greater than 0"),
    ({"tune": {"trials": -1}}, "tune.trials=-1: Input should be greater than or equal to 0"),
    ({"tune": {"trials": True}}, "tune.trials=True: Input should be a valid integer"),
    ({"tune": {"trials": 5}}, "tune.trials=5 needs candidates timed on the device"),
    ({"target": {"mcpu": "cortex-a7z"}}, "target.mcpu='cortex-a7z' is not a CPU LLVM knows for "
                                         "aarch64-linux-gnu; allowed, e.g.: ['cortex-a78'"),
    ({"target": {"mattr": ["+neom"]}}, "target.mattr has '+neom', not a feature LLVM knows"),
    ({"extends": "rpi4"}, "cycle: rpi4 -> rpi4"),
    ({"cuda_graph": True}, "cuda_graph=true needs a CUDA target, but target.kind='llvm'"),
    ({"gemm_library": "cublas"}, "gemm_library='cublas' needs a CUDA target, but "
                                 "target.kind='llvm'"),
    ({"gemm_library": "cudnn"}, "gemm_library='cudnn': Input should be 'cublas'"),
])
def test_bad_profiles_are_named(override, message):
    with pytest.raises(ConfigError, match="rpi4.yaml with profiles.rpi4 from params.yaml|cycle") \
            as err:
        load_profile("rpi4", {"rpi4": override})
    assert message in str(err.value)


def test_unknown_device_and_host_in_devices_refused_at_compose():
    with pytest.raises(ConfigError, match=r"'rpi9' has no profile; allowed: \['android_sd8g2'"):
        compose_text(["devices=[rpi4,rpi9]"])
    # every case is built for the host: devices are the others
    with pytest.raises(ConfigError, match=r"devices='host' \(from conf/experiment\): every "
                                          "case is built for the host"):
        compose_text(["devices=[host,rpi4]"])


# --- builds -------------------------------------------------------------------------------

def _needs(tool: str, package: str):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not on PATH (Debian package {package}; `pock setup` installs it)")


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """A small training step (decoder, paper scheme) through the chain's phases, optimized and
    not yet built, and the initial value of each parameter (by Relax name)."""
    from pipelines.compile import compile_to_plan

    params = compose_params(*[f"models.llama_tiny.kwargs.{k}={v}" for k, v in SIZE.items()],
                            "models.llama_tiny.batch_size=2")
    full, _, optimized = compile_to_plan(params.models["llama_tiny"],
                                         params.schemes["transformer_paper"].rules, OPT,
                                         scheme_name="transformer_paper")
    return optimized, full.initial


def _build(step, profile, directory):
    """The step built for ``profile`` into ``directory``, as the build stages write it
    (stages/build.py); what the build recorded."""
    from pipelines.compile import build

    return build(step[0].module, step[0].plan, profile, directory).built


def _batch(signature: dict, seed: int = 0):
    """Token ids and labels below the vocabulary, of the step's shapes."""
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, SIZE["vocab"], signature["data_types"][n]["shape"])
                 .astype(signature["data_types"][n]["dtype"]) for n in signature["data"])


@pytest.fixture(scope="module")
def host_run(step, host_profile, tmp_path_factory):
    """The host build, its arguments for one step and its outputs (the reference)."""
    from pipelines.runtime.step import CompiledStep

    directory = tmp_path_factory.mktemp("host")
    _build(step, host_profile, directory)
    compiled = CompiledStep(directory, step[1])
    args = compiled.arguments(*_batch(compiled.signature))
    arrays = [a.numpy() for a in args]  # before the step, which updates its state in place
    outputs = [o.numpy() for o in compiled.function(*args)]
    return directory, arrays, outputs


@pytest.fixture(scope="module")
def rpi4_build(step, tmp_path_factory):
    _needs("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
    directory = tmp_path_factory.mktemp("rpi4")
    built = _build(step, load_profile("rpi4", {}), directory)
    return directory, built


@pytest.mark.slow
def test_rpi4_build_is_an_aarch64_shared_library(rpi4_build):
    directory, built = rpi4_build
    header = (directory / built["library"]).read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # AArch64
    assert built["cc"] == "aarch64-linux-gnu-g++" and not built["links_on_device"]
    assert (directory / "signature.json").exists()


@pytest.fixture(scope="module")
def apple_build(step, tmp_path_factory):
    directory = tmp_path_factory.mktemp("apple_m1")
    return directory, _build(step, load_profile("apple_m1", {}), directory)


@pytest.mark.slow
def test_apple_m1_build_is_an_archive_of_macho_objects(apple_build):
    directory, built = apple_build
    assert built["library"] == "step.tar" and built["links_on_device"]
    with tarfile.open(directory / "step.tar") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == sorted(m.name for m in members)
        assert all(m.mtime == 0 and m.uid == 0 for m in members)  # reproducible bytes
        magics = {tar.extractfile(m).read(4) for m in members}
    assert magics == {b"\xcf\xfa\xed\xfe"}  # 64-bit Mach-O, every object


@pytest.mark.slow
def test_jetson_build_carries_nvcc_compiled_kernels(step, tmp_path):
    _needs("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
    _needs("nvcc", "nvidia-cuda-toolkit")
    built = _build(step, load_profile("jetson_orin", {}), tmp_path)
    data = (tmp_path / "step.so").read_bytes()
    assert built["cuda"]["arch"] == "sm_87" and built["cuda"]["fatbin_bytes"] > 0
    assert b"\x50\xed\x55\xba" in data  # fatbin magic: kernels compiled here, not source
    assert b"__global__" not in data
    assert sum(built["kernel_schedules"].values()) > 0


@pytest.mark.slow
def test_android_adreno_opencl_build_is_an_archive_with_the_kernels(step, tmp_path):
    """The phone's GPU: OpenCL kernels (source, compiled by the phone's driver at load) packed
    beside the aarch64 host objects."""
    phone = load_profile("android_sd8g2", {})
    profile = phone.model_copy(update={"target": {"kind": "opencl", "device": "adreno"},
                                       "host": dict(phone.target)})
    built = _build(step, profile, tmp_path)
    assert built["library"] == "step.tar" and sum(built["kernel_schedules"].values()) > 0
    with tarfile.open(tmp_path / "step.tar") as tar:
        blobs = b"".join(tar.extractfile(m).read() for m in tar.getmembers())
    assert b"__kernel void" in blobs


def test_sampled_peak_sees_memory_held_between_reads():
    from pipelines.runtime.sampled_peak import SampledPeak, resident_bytes

    size, before = 256 * 2**20, resident_bytes()
    with SampledPeak(interval_s=0.001) as peak:
        block = bytearray(size)
        block[::4096] = b"\1" * len(range(0, size, 4096))  # every page resident
        time.sleep(0.05)
        del block
    assert peak.sampled >= before + 0.9 * size
    assert peak.bytes >= peak.sampled


def test_missing_cross_compiler_names_the_package(tmp_path):
    """Refused before anything is compiled or written (backend/build.py checks the toolchain
    first)."""
    import tvm

    from pipelines.backend.build import build_step

    profile = load_profile("rpi4", {"rpi4": {"toolchain": {"cc": "no-such-g++"}}})
    with pytest.raises(ConfigError, match="rpi4.yaml: toolchain.cc='no-such-g\\+\\+' is not on "
                                          "PATH; install the Debian package "
                                          "g\\+\\+-aarch64-linux-gnu"):
        build_step(tvm.IRModule({}), profile, tmp_path)
    assert not list(tmp_path.iterdir())


# --- runners ------------------------------------------------------------------------------

def _assert_same_step(got, want):
    assert len(got) == len(want)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_emulated_rpi4_step_matches_the_host_build(rpi4_build, host_run):
    from pipelines.runtime.runners.emulated import check_emulation, run

    profile = load_profile("rpi4", {})
    try:
        check_emulation(profile)
    except ConfigError as err:  # qemu or the root absent: says which, and how to get it
        pytest.skip(str(err))
    directory, built = rpi4_build
    _, args, want = host_run
    got, times, info = run(directory / built["library"], args, profile, warmup=1, steps=2)
    _assert_same_step(got, want)
    assert len(times) == 2 and min(times) > 0 and info["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_native_runner_on_emulated_rpi4_agrees_with_the_python_runner(step, rpi4_build, host_run,
                                                                      tmp_path):
    """The native runner cross-built for aarch64 (Debian's g++, TVM's runtime libraries from the
    aarch64 wheels) runs the rpi4 build under qemu, no Python: on the same batches as the
    Python runner on the host build, its losses and weights agree to the device tolerance
    (runtime/agreement.py)."""
    from pipelines.runtime.native import (build_runner, run_native, run_python, save_data,
                                          step_directory)
    from pipelines.runtime.package import agreement
    from pipelines.runtime.runners.emulated import check_emulation

    profile = load_profile("rpi4", {})
    try:
        check_emulation(profile)
    except ConfigError as err:
        pytest.skip(str(err))
    runner = build_runner(profile, tmp_path / "runner")
    header = runner.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183
    directory, built = rpi4_build
    signature = json.loads((directory / "signature.json").read_text())
    batches = [_batch(signature, seed) for seed in range(3)]
    data, native, python = (tmp_path / n for n in ("data", "native", "python"))
    for d in (data, native, python):
        d.mkdir()
    save_data(data / "train.safetensors", signature,
              tuple(np.concatenate(arrays) for arrays in zip(*batches)))
    device_step = step_directory(directory, step[1], tmp_path / "rpi4")
    log = run_native(runner, device_step, data, native, profile, ("--epochs", "2"))
    host_step = step_directory(host_run[0], step[1], tmp_path / "host")
    run_python(host_step, data, python, 2, 600, ("--epochs", "2"))
    assert log["steps"] == 6 and log["runner"] == "native"
    assert agreement(native, python, host_step)["matches_python"]


def test_emulation_without_qemu_or_a_root_says_how_to_get_them(tmp_path):
    from pipelines.runtime.runners.emulated import check_emulation

    profile = load_profile("rpi4", {"rpi4": {"emulation": {"qemu": "no-such-qemu"}}})
    with pytest.raises(ConfigError, match="emulation.qemu='no-such-qemu' is not on PATH; "
                                          "install the Debian package qemu-user-static"):
        check_emulation(profile)
    # a qemu there (any program on PATH stands in for it), no root
    profile = load_profile("rpi4", {"rpi4": {"emulation": {"qemu": "sh", "root": str(tmp_path)}}})
    with pytest.raises(ConfigError, match=f"emulation.root={tmp_path} holds no emulation root.*"
                                          "pock emulation setup rpi4"):
        check_emulation(profile)


@pytest.mark.slow
def test_local_run_on_device_checks_against_the_host_build(step, host_run, host_profile):
    """The benchmark stage's path for a local runner: one step of the device's build checked
    against the host build's on the same arguments, then timed here."""
    from pipelines.evaluate.device import run_on_device, summary
    from pipelines.runtime.step import CompiledStep

    directory, _, want = host_run
    batch = _batch(CompiledStep(directory, step[1]).signature)
    result = run_on_device("host", host_profile, directory, step[1], batch, want,
                           warmup=1, steps=2)
    assert result["ran"] and result["verdict"] == "ok" and result["matches_host"]
    assert result["compiled"]["steps"] == 2 and result["compiled"]["median_ms"] > 0
    assert "matches the host build's" in summary(result)


@pytest.mark.slow
def test_runner_none_says_it_did_not_run_and_how_to_reach_it(step, apple_build, host_run):
    from pipelines.evaluate.device import run_on_device

    directory, _ = apple_build
    batch = _batch(signature_of(step[0].module))
    result = run_on_device("apple_m1", load_profile("apple_m1", {}), directory, step[1], batch,
                           host_run[2], warmup=1, steps=1)
    assert not result["ran"]
    assert "the archive is linked on the device" in result["reason"]
    assert "+profiles.apple_m1.runner=rpc" in result["reason"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tracker():
    """A TVM RPC tracker and one server under key 'pock-test', both on loopback."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                               "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        from tvm import rpc

        deadline = time.time() + 60
        while True:  # the tracker is up when its port accepts
            assert procs[0].poll() is None, "RPC tracker exited (is tornado installed?)"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "RPC tracker did not start"
                time.sleep(0.3)
        server_port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
             "--key", "pock-test", "--host", "127.0.0.1", "--port", str(server_port),
             "--port-end", str(server_port + 1)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while "pock-test" not in rpc.connect_tracker("127.0.0.1", port).summary()["queue_info"]:
            assert time.time() < deadline, "RPC server did not register with the tracker"
            time.sleep(0.3)
        yield f"127.0.0.1:{port}"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _rpc_profile(tracker: str, key: str = "pock-test"):
    return load_profile("host", {"host": {"runner": "rpc", "remote": {
        "tracker": tracker, "key": key, "timeout_s": 120}}})


@pytest.mark.slow
def test_rpc_loopback_step_matches_and_is_timed_on_the_server(host_run, tracker):
    from pipelines.runtime.runners.rpc import run as run_rpc

    directory, args, want = host_run
    got, times, _ = run_rpc(directory / "step.so", args, _rpc_profile(tracker), warmup=1, steps=3)
    _assert_same_step(got, want)
    assert len(times) == 3 and min(times) > 0


@pytest.mark.slow
def test_rpc_unknown_key_lists_the_registered_ones(host_run, tracker):
    from pipelines.runtime.runners.rpc import run as run_rpc

    directory, args, _ = host_run
    with pytest.raises(ConfigError, match=r"remote.key='rpi4' is not registered .* "
                                          r"registered keys: \['pock-test'\]"):
        run_rpc(directory / "step.so", args, _rpc_profile(tracker, "rpi4"), 1, 1)


def test_rpc_without_a_tracker_fails_at_once(tmp_path):
    """Named before anything is uploaded: no build is needed to see it."""
    from pipelines.runtime.runners.rpc import run as run_rpc

    start = time.time()
    with pytest.raises(ConfigError, match="no RPC tracker answers at remote.tracker=127.0.0.1:"):
        run_rpc(tmp_path / "step.so", [], _rpc_profile(f"127.0.0.1:{_free_port()}"), 1, 1)
    assert time.time() - start < 10


def test_a_device_step_matches_elementwise_or_by_its_change():
    """The device check (pipelines/runtime/agreement.compare): a gradient element flipped at a
    ReLU6 edge moves one update a few percent of its change: it matches; an update off by its
    whole change, or a different loss, does not."""
    from pipelines.runtime.agreement import compare

    rng = np.random.default_rng(0)
    before = rng.standard_normal(200).astype("float32")
    change = 1e-3 * rng.standard_normal(200).astype("float32")
    host = [np.float32(2.3), before + change]
    assert compare(host, host, [None, before])["matches_host"]
    flipped = change.copy()
    flipped[7] *= 0.5  # one element's gradient halved: a few percent of the change
    result = compare([host[0], before + flipped], host, [None, before])
    assert result["matches_host"] and result["worst_diff_over_tolerance"] > 1
    assert 0 < result["worst_change_error"] < 0.05
    wrong = compare([host[0], before - change], host, [None, before])
    assert not wrong["matches_host"] and wrong["worst_change_error"] > 1
    assert not compare([np.float32(2.4), host[1]], host, [None, before])["matches_host"]


def test_an_adam_update_at_float_noise_matches_by_its_gradient():
    """Adam's first step moves an element by ~lr whatever its gradient, so where the gradient
    is float noise (1e-11: a key bias's) the two builds move it opposite ways. Matched when the
    first moments agree to RTOL of the step's largest; a gradient off at its own scale is not."""
    from pipelines.runtime.agreement import adam_first_moments, compare

    rng = np.random.default_rng(0)
    signature = {"outputs": ["loss", "new_p_q", "new_p_v", "new_m_p_q", "new_m_p_v"],
                 "optimizer_state": {"m_p_q": {"param": "p_q", "slot": "m", "torch": "exp_avg"},
                                     "m_p_v": {"param": "p_v", "slot": "m", "torch": "exp_avg"}}}
    before = ([None] + [rng.standard_normal(64).astype("float32") for _ in range(2)]
              + [np.zeros(64, "float32")] * 2)  # the weights, then their moments

    def step(gradient_q, gradient_v):  # the outputs of Adam's first step, lr 1e-3
        return [np.float32(2.3), before[1] - 1e-3 * np.sign(gradient_q),
                before[2] - 1e-3 * np.sign(gradient_v), 0.1 * gradient_q, 0.1 * gradient_v]

    noise, value = 1e-11 * rng.standard_normal(64), 1e-2 * rng.standard_normal(64)
    host = step(noise, value)
    device = step(1e-11 * rng.standard_normal(64), value)  # other noise, same real gradient
    assert not compare(device, host, before)["matches_host"]
    result = compare(device, host, before,
                     adam_first_moments(signature, device, host))
    assert result["matches_host"] and result["matched_by_gradient"] == 1
    wrong = step(noise, -value)  # the value bias's gradient negated
    assert not compare(wrong, host, before,
                       adam_first_moments(signature, wrong, host))["matches_host"]
