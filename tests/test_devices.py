"""Device profiles, cross-compiled builds and the runners that reach devices.

- every shipped profile resolves; a board is added by configuration only (a YAML file that
  extends another, or Hydra overrides), and bad profiles are refused naming file, key and
  allowed values;
- one small step (a 2-block LLaMA-style decoder, the paper's transformer scheme) built for:
  rpi4 (aarch64 ELF, linked by Debian's cross g++), apple_m1 (an archive of Mach-O objects the
  Mac links), jetson_orin (CUDA kernels compiled by nvcc into a fatbin);
- the emulated runner (qemu user mode) runs the aarch64 build and gets the host build's loss and
  updated weights; the RPC runner does the same through a tracker and server on loopback that
  the test starts and stops; missing tracker, key, toolchain or root are named at once.
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
import tvm
import yaml

import pipelines.config as config
from pipelines.compose import compose_text
from pipelines.config import CONF, ConfigError, load_profile
from pipelines.step import CompiledStep
from stages.benchmark.remote import check_emulation, run_emulated, run_rpc
from stages.build.toolchain import compile_step
from stages.optimize.passes import optimize
from stages.prune.prune import sparse_step
from stages.prune.scheme import select
from stages.prune.show import full_step

MODEL = {"name": "llama_test", "arch": "llama", "vocab": 64, "dim": 32, "layers": 2, "heads": 2,
         "hidden": 48, "seq_len": 16, "batch_size": 2}
OPT = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
SHIPPED = ["host", "rpi4", "jetson_orin", "android_sd8g2", "apple_m1", "edge_x86"]


# --- profiles -----------------------------------------------------------------------------

def test_every_profile_resolves_to_a_tvm_target():
    assert set(SHIPPED) <= set(config.available_profiles())
    for name in config.available_profiles():
        profile = load_profile(name, {})
        assert profile["name"] == name
        assert tvm.target.Target(profile["target"]).kind.name in ("llvm", "cuda")


def test_a_board_from_hydra_overrides_only():
    text = compose_text(["devices=[host,rpi5]", "+profiles.rpi5.extends=rpi4",
                         "+profiles.rpi5.target.mcpu=cortex-a76", "+profiles.rpi5.memory_mb=8192"])
    params = yaml.safe_load(text)
    rpi5 = load_profile("rpi5", params["profiles"])
    rpi4 = load_profile("rpi4", {})
    assert rpi5["target"] == dict(rpi4["target"], mcpu="cortex-a76")
    assert rpi5["memory_mb"] == 8192 and rpi5["toolchain"] == rpi4["toolchain"]
    # An override of a base reaches the boards derived from it.
    assert load_profile("rpi5", {**params["profiles"], "rpi4": {"cores": 2}})["cores"] == 2


def test_a_board_from_a_new_yaml_file(tmp_path, monkeypatch):
    for name in SHIPPED:
        shutil.copy(config.PROFILES / f"{name}.yaml", tmp_path)
    (tmp_path / "orin_nano.yaml").write_text(
        "extends: jetson_orin\ndescription: Jetson Orin Nano 8GB\ncores: 6\nmemory_mb: 8192\n"
        "memory_budget_mb: 4096\n")
    monkeypatch.setattr(config, "PROFILES", tmp_path)
    nano = load_profile("orin_nano", {})
    assert nano["target"]["arch"] == "sm_87" and nano["cores"] == 6
    assert "orin_nano" in config.available_profiles()


@pytest.mark.parametrize("override, message", [
    ({"runner": "ssh"}, "runner='ssh' is not one of ['docker', 'emulated', 'local', 'none', 'rpc']"),
    ({"toolchain": {"output": "zip"}}, "toolchain.output='zip' is not one of ['archive', "),
    ({"speed": 3}, "unknown keys ['speed']"),
    ({"runner": "rpc", "remote": {"tracker": "somewhere", "key": "k"}},
     "remote.tracker='somewhere'; allowed: HOST:PORT"),
    ({"runner": "local", "toolchain": {"output": "archive"}}, "allowed with an archive"),
    ({"extends": "rpi4"}, "cycle: rpi4 -> rpi4"),
])
def test_bad_profiles_are_named(override, message):
    with pytest.raises(ConfigError, match="rpi4.yaml|cycle") as err:
        load_profile("rpi4", {"rpi4": override})
    assert message in str(err.value)


def test_unknown_device_and_missing_host_refused_at_compose():
    with pytest.raises(ConfigError, match=r"'rpi9' has no profile; allowed: \['android_sd8g2'"):
        compose_text(["devices=[host,rpi9]"])
    with pytest.raises(ConfigError, match="lacks 'host'"):
        compose_text(["devices=[rpi4]"])


# --- builds -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def step():
    """A small training step (decoder, paper scheme) and its host build and arguments."""
    layers, full, signature = full_step(MODEL, OPT)
    scheme = yaml.safe_load((CONF / "sparse" / "transformer_paper.yaml").read_text())
    pruned, sig, _ = sparse_step(full, signature, select(scheme, layers))
    return optimize(pruned, dict(sig, scheme="transformer_paper"), reorder=True), sig


@pytest.fixture(scope="module")
def host_run(step, tmp_path_factory):
    """The host build, its arguments for one step and its outputs (the reference)."""
    import torch

    from pipelines.models import build_model

    mod, sig = step
    directory = tmp_path_factory.mktemp("host")
    compile_step(mod, load_profile("host", {}), directory)
    (directory / "signature.json").write_text(json.dumps(sig))
    torch.manual_seed(0)
    state = build_model(MODEL).state_dict()
    compiled = CompiledStep(directory, {r: state[t].numpy()
                                        for r, t in sig["torch_names"].items()})
    rng = np.random.default_rng(0)
    args = compiled.arguments(rng.integers(0, 64, (2, 16)), rng.integers(0, 64, 32))
    outputs = [o.numpy() for o in compiled.function(*args)]
    return directory, [a.numpy() for a in args], outputs


def _needs(tool: str, package: str):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not on PATH (Debian package {package}; .ci/run installs it)")


@pytest.fixture(scope="module")
def rpi4_build(step, tmp_path_factory):
    _needs("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
    directory = tmp_path_factory.mktemp("rpi4")
    built = compile_step(step[0], load_profile("rpi4", {}), directory)
    return directory / built["library"], built


def test_rpi4_build_is_an_aarch64_shared_library(rpi4_build):
    library, built = rpi4_build
    header = library.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # AArch64
    assert built["cc"] == "aarch64-linux-gnu-g++" and not built["links_on_device"]


def test_apple_m1_build_is_an_archive_of_macho_objects(step, tmp_path):
    built = compile_step(step[0], load_profile("apple_m1", {}), tmp_path)
    assert built["library"] == "step.tar" and built["links_on_device"]
    with tarfile.open(tmp_path / "step.tar") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == sorted(m.name for m in members)
        assert all(m.mtime == 0 and m.uid == 0 for m in members)  # reproducible bytes
        magics = {tar.extractfile(m).read(4) for m in members}
    assert magics == {b"\xcf\xfa\xed\xfe"}  # 64-bit Mach-O, every object


def test_jetson_build_carries_nvcc_compiled_kernels(step, tmp_path):
    _needs("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
    _needs("nvcc", "nvidia-cuda-toolkit")
    built = compile_step(step[0], load_profile("jetson_orin", {}), tmp_path)
    data = (tmp_path / "step.so").read_bytes()
    assert built["cuda"]["arch"] == "sm_87" and built["cuda"]["fatbin_bytes"] > 0
    assert b"\x50\xed\x55\xba" in data  # fatbin magic: kernels compiled here, not source
    assert b"__global__" not in data
    assert sum(built["kernel_schedules"].values()) > 0


def test_android_adreno_opencl_build_is_an_archive_with_the_kernels(step, tmp_path):
    """The phone's GPU: OpenCL kernels (source, compiled by the phone's driver at load) packed
    beside the aarch64 host objects."""
    profile = load_profile("android_sd8g2", {})
    profile.update(target={"kind": "opencl", "device": "adreno"},
                   host=dict(profile["target"]))
    built = compile_step(step[0], profile, tmp_path)
    assert built["library"] == "step.tar" and sum(built["kernel_schedules"].values()) > 0
    with tarfile.open(tmp_path / "step.tar") as tar:
        blobs = b"".join(tar.extractfile(m).read() for m in tar.getmembers())
    assert b"__kernel void" in blobs


def test_missing_cross_compiler_names_the_package(step, tmp_path):
    profile = load_profile("rpi4", {"rpi4": {"toolchain": {"cc": "no-such-g++"}}})
    with pytest.raises(ConfigError, match="no-such-g\\+\\+' is not on PATH; install the Debian "
                                          "package g\\+\\+-aarch64-linux-gnu"):
        compile_step(step[0], profile, tmp_path)
    assert not list(tmp_path.iterdir())


# --- runners ------------------------------------------------------------------------------

def _assert_same_step(got, want):
    assert len(got) == len(want)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_emulated_rpi4_step_matches_the_host_build(rpi4_build, host_run):
    profile = load_profile("rpi4", {})
    try:
        check_emulation(profile)
    except ConfigError as err:
        pytest.skip(str(err))
    _, args, want = host_run
    got, times, info = run_emulated(rpi4_build[0], args, profile, warmup=1, steps=2)
    _assert_same_step(got, want)
    assert len(times) == 2 and min(times) > 0 and info["peak_rss_bytes"] > 0


def test_emulation_without_a_root_says_how_to_make_one(tmp_path):
    profile = load_profile("rpi4", {"rpi4": {"emulation": {"root": str(tmp_path)}}})
    with pytest.raises(ConfigError, match="pock emulation setup rpi4"):
        check_emulation(profile)


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

        deadline = time.time() + 30
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


def _rpc_profile(tracker: str, key: str = "pock-test") -> dict:
    return load_profile("host", {"host": {"runner": "rpc", "remote": {
        "tracker": tracker, "key": key, "timeout_s": 120}}})


def test_rpc_loopback_step_matches_and_is_timed_on_the_server(host_run, tracker):
    directory, args, want = host_run
    got, times, _ = run_rpc(directory / "step.so", args, _rpc_profile(tracker), warmup=1, steps=3)
    _assert_same_step(got, want)
    assert len(times) == 3 and min(times) > 0


def test_rpc_unknown_key_lists_the_registered_ones(host_run, tracker):
    directory, args, _ = host_run
    with pytest.raises(ConfigError, match=r"remote.key='rpi4' is not registered .* "
                                          r"registered keys: \['pock-test'\]"):
        run_rpc(directory / "step.so", args, _rpc_profile(tracker, "rpi4"), 1, 1)


def test_rpc_without_a_tracker_fails_at_once(host_run):
    directory, args, _ = host_run
    start = time.time()
    with pytest.raises(ConfigError, match="no RPC tracker answers at remote.tracker=127.0.0.1:"):
        run_rpc(directory / "step.so", args, _rpc_profile(f"127.0.0.1:{_free_port()}"), 1, 1)
    assert time.time() - start < 10
