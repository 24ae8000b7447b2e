"""Docker images made here, with no registry and no `docker build`: content-addressed layers.

An image is a stack of layer tarballs:
1. Debian: a minimal bookworm for the device's architecture (python3 and the C++ runtime),
   made by mmdebstrap with SOURCE_DATE_EPOCH fixed, so the same Debian packages give the same
   bytes;
2. Python: the device's wheels of TVM and numpy at the versions installed here;
3. for a package, the application (pipelines/runtime/package.py); for PyTorch's peers in a
   device's container, PyTorch's CPU wheel (``pytorch_layers``; for ``torch.compile``'s, over a
   Debian with g++ and Python's headers, and with PyTorch's own: ``torch_compile_layers``); for
   the TensorFlow peers, TensorFlow's (``tensorflow_layers``); for the TFLite peers, LiteRT's
   (``litert_layers``); for ONNX Runtime's, its training wheel
   (``ort_layers``); for ExecuTorch's, its wheel over PyTorch's (``executorch_layers``).
Every layer is a deterministic tar (sorted names, zero times and owners) and the image config
has fixed times, so the image ID, the sha256 of the config, is a hash of the content: the same
inputs give the same ID, and the tag is derived from it. A stage records the ID beside its DVC
outputs; when the engine lacks the image, the stage that needs it loads it again from the same
layers, and the ID must come out the same.

The Debian and Python layers are cached under ~/.cache/pockengine/layers, keyed by what they
are made from (architecture, packages, wheel versions).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

from pipelines.io import sha256_file
from pipelines.schema import ConfigError
from pipelines.runtime.emulation import (ARCHITECTURES, DEBIAN, WHEELS, debian_command,
                                 device_architecture, install_wheels)

# PyTorch's CPU wheel and what it imports (torch.export's loader needs sympy), for the peers'
# image; without its C++ headers, test binaries and tools (a third of the wheel), which training
# in Python never loads (torch/bin holds the shared-memory manager torch starts with)
PYTORCH_WHEELS = ["torch", "numpy", "typing_extensions", "filelock", "fsspec", "jinja2",
                  "markupsafe", "networkx", "sympy", "mpmath", "setuptools"]
PYTORCH_UNUSED = ["torch/include", "torch/test", "torch/share"]
# torch.compile's Inductor writes its CPU kernels in C++ and compiles them when the step first
# runs: g++ (with OpenMP's libgomp) against Python's headers and PyTorch's (torch/include, a
# layer of its own over PyTorch's, so the wheel's layer is the same file as the eager peers');
# it keys its kernel cache by a checksum of the preprocessed headers that it asks openssl for
TORCH_COMPILE_DEBIAN = [*DEBIAN, "g++", "python3-dev", "openssl"]
PYTORCH_HEADERS = "torch/include"
# TensorFlow's CPU wheel (x86-64 only: on Arm, PyPI's CPU build is the `tensorflow` wheel) and
# what `import tensorflow` and loading a SavedModel import, for the TensorFlow peers' image;
# without its C++ headers (a fifth of the wheel), which running a saved step never reads
TENSORFLOW_WHEELS = ["tensorflow-cpu", "numpy", "absl-py", "protobuf", "ml_dtypes", "wrapt",
                     "typing_extensions", "gast", "astunparse", "six", "termcolor", "opt_einsum",
                     "packaging", "flatbuffers", "requests", "urllib3", "idna", "certifi",
                     "charset-normalizer"]
TENSORFLOW_UNUSED = ["tensorflow/include"]
# LiteRT's interpreter imports only itself and numpy, for the TFLite peers' image
LITERT_WHEELS = ["ai-edge-litert", "numpy"]
# ONNX Runtime training's API needs only its own wheel and numpy (runtime/ort_in_container.py)
ORT_WHEELS = ["onnxruntime-training-cpu", "numpy"]
# ExecuTorch's runtime binding takes PyTorch's tensors (and links its libraries); its package
# imports, besides, these three (runtime/executorch_in_container.py)
EXECUTORCH_WHEELS = ["executorch", "ruamel.yaml", "flatbuffers", "tabulate"]

CACHE = Path(os.environ.get("POCKENGINE_CACHE", "~/.cache/pockengine")).expanduser() / "layers"
ENGINE_HELP = ("start one as root: `dockerd --storage-driver=vfs --iptables=false --bridge=none &` "
               "(Debian package docker.io; `pock setup` installs and starts it)")
SITE = "opt/pockengine"  # where the Python layer puts TVM and numpy (on PYTHONPATH)
EPOCH = "0"              # SOURCE_DATE_EPOCH for mmdebstrap


def engine():
    """A client of the local Docker engine, or a ConfigError saying how to start one."""
    import docker

    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except docker.errors.DockerException as err:
        raise ConfigError(f"no Docker engine answers ({err}); {ENGINE_HELP}") from None
    return client


def start_engine(wait_s: float = 60) -> str:
    """Start dockerd (as root) where none answers, as DESIGN.md says works here: vfs storage,
    no iptables, no bridge (containers run with no network). Returns what it did."""
    import time

    try:
        engine()
        return "a Docker engine already answers"
    except ConfigError:
        pass
    if shutil.which("dockerd") is None:
        raise ConfigError("dockerd is not on PATH; install the Debian package docker.io")
    log = CACHE.parent / "dockerd.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        subprocess.Popen(["dockerd", "--storage-driver=vfs", "--iptables=false",
                          "--bridge=none"], stdout=handle, stderr=handle,
                         start_new_session=True)  # outlives this command
    deadline = time.monotonic() + wait_s
    while True:
        try:
            engine()
            return f"started dockerd (log: {log})"
        except ConfigError:
            if time.monotonic() > deadline:
                raise ConfigError(f"dockerd did not answer within {wait_s:.0f} s; see {log}")
            time.sleep(1)


@functools.lru_cache(maxsize=None)
def _digest(path: str, size: int, mtime: int) -> str:
    return sha256_file(Path(path))


def diff_id(path: Path) -> str:
    """A layer's digest (cached: the layers are hundreds of MiB)."""
    stat = Path(path).stat()
    return "sha256:" + _digest(str(path), stat.st_size, stat.st_mtime_ns)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def add_tree(tar: tarfile.TarFile, directory: Path, prefix: str) -> None:
    """``directory``'s contents under ``prefix`` in ``tar``, reproducibly."""
    directory = Path(directory)
    for path in sorted(directory.rglob("*"), key=lambda p: str(p.relative_to(directory))):
        info = tar.gettarinfo(str(path), arcname=f"{prefix}/{path.relative_to(directory)}")
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        if info.isfile():
            with open(path, "rb") as handle:
                tar.addfile(info, handle)
        else:
            tar.addfile(info)


def _cached(name: str, make) -> Path:
    """The cached layer ``name``, made by ``make(path)`` into a temporary file if missing."""
    path = CACHE / name
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=CACHE, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            make(Path(tmp))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def debian_layer(arch: str, packages: list[str] = DEBIAN, drop: tuple[str, ...] = ()) -> Path:
    """A minimal Debian of ``packages`` for ``arch``, without the files matching ``drop``
    (fnmatch patterns of tar member names)."""
    def make(path: Path) -> None:
        env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH)
        # mmdebstrap picks the output format from the name
        made = path.with_suffix(".tar")
        subprocess.run(debian_command(arch, made, packages), check=True, env=env)
        if not drop:
            os.replace(made, path)
            return
        with tarfile.open(made) as source, tarfile.open(path, "w",
                                                        format=tarfile.GNU_FORMAT) as tar:
            for member in source:  # in mmdebstrap's order, metadata as it made it
                if not any(fnmatch.fnmatch(member.name, p) for p in drop):
                    tar.addfile(member, source.extractfile(member) if member.isfile() else None)
        os.unlink(made)

    return _cached(f"debian-{arch}-{_key('bookworm', packages, EPOCH, drop)}.tar", make)


def python_layer(arch: str, wheels: list[str] = WHEELS, name: str = "python",
                 unused: list[str] = ()) -> Path:
    """The device's ``wheels`` (the versions installed here) under SITE, without the
    directories ``unused``: TVM and numpy by default."""
    pins = {w: version(w) for w in wheels}

    def make(path: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            site = Path(tmp)
            install_wheels(arch, site, wheels)
            for directory in unused:
                shutil.rmtree(site / directory)
            # Console scripts carry the shebang of the interpreter pip ran under (this
            # checkout's venv), so the layer would depend on where it was made; the image runs
            # python3 itself. Left out, with their RECORD lines.
            shutil.rmtree(site / "bin", ignore_errors=True)
            for record in site.glob("*.dist-info/RECORD"):
                lines = record.read_text().splitlines(keepends=True)
                record.write_text("".join(l for l in lines if not l.startswith("../")))
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                add_tree(tar, site, SITE)

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    # without ``unused``, the key the TVM layer has always had (its cached file stays valid)
    key = _key(python, pins, 'no-scripts', *([list(unused)] if unused else []))
    return _cached(f"{name}-{arch}-{key}.tar", make)


def packageable(profile) -> str:
    """The architecture of the image that runs the profile's build, or a ConfigError: the image
    holds a shared library and TVM's CPU runtime."""
    if profile.toolchain.output != "shared" or profile.target["kind"] != "llvm":
        raise ConfigError(f"{profile.source}: a container image runs a CPU build linked here "
                          f"(target kind llvm, toolchain.output shared); this profile has "
                          f"target kind {profile.target['kind']!r} and output "
                          f"{profile.toolchain.output!r}")
    return device_architecture(profile, "a container image")


def runs_here(arch: str) -> str | None:
    """None if this machine runs images of ``arch`` natively, else why not."""
    machine = os.uname().machine
    return None if arch == machine else (
        f"the {ARCHITECTURES[arch][0]} image is built, not run: this machine ({machine}) runs "
        "containers of its own architecture only")


def _known(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ConfigError(f"no container image for architecture {arch!r}; allowed: "
                          f"{sorted(ARCHITECTURES)}")


def runtime_layers(arch: str) -> list[Path]:
    """Debian and Python layers for a device of architecture ``arch`` (target mtriple's)."""
    _known(arch)
    return [debian_layer(arch), python_layer(arch)]


def pytorch_layers(arch: str) -> list[Path]:
    """Debian and PyTorch (CPU) with numpy, the versions installed here, no TVM: what a peer
    needs to train in a device's container (pipelines/evaluate/container_peers.py)."""
    _known(arch)
    return [debian_layer(arch),
            python_layer(arch, PYTORCH_WHEELS, "pytorch", PYTORCH_UNUSED)]


def headers_layer(arch: str) -> Path:
    """PyTorch's headers (the device's wheel, the version installed here) under SITE, alone:
    what its python_layer leaves out as unused."""
    def make(path: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            site = Path(tmp)
            install_wheels(arch, site, ["torch"])
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                add_tree(tar, site / PYTORCH_HEADERS, f"{SITE}/{PYTORCH_HEADERS}")

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = _key(python, "torch", version("torch"), PYTORCH_HEADERS)
    return _cached(f"headers-{arch}-{key}.tar", make)


def torch_compile_layers(arch: str) -> list[Path]:
    """A Debian with g++ and Python's headers, PyTorch's layer and its headers: what a
    ``torch.compile`` peer needs to compile its kernels and train in a device's container."""
    _known(arch)
    return [debian_layer(arch, TORCH_COMPILE_DEBIAN),
            python_layer(arch, PYTORCH_WHEELS, "pytorch", PYTORCH_UNUSED), headers_layer(arch)]


def tensorflow_layers(arch: str) -> list[Path]:
    """Debian and TensorFlow (CPU), the versions installed here, no TVM: what a TensorFlow peer
    needs to run its saved step in a device's container (evaluate/container_peers.py)."""
    _known(arch)
    return [debian_layer(arch),
            python_layer(arch, TENSORFLOW_WHEELS, "tensorflow", TENSORFLOW_UNUSED)]


def litert_layers(arch: str) -> list[Path]:
    """Debian and LiteRT's interpreter with numpy, the versions installed here, no TVM: what a
    TFLite peer needs to train in a device's container (evaluate/container_peers.py)."""
    _known(arch)
    return [debian_layer(arch), python_layer(arch, LITERT_WHEELS, "litert")]


def ort_layers(arch: str) -> list[Path]:
    """Debian and ONNX Runtime training with numpy, the versions installed here, no TVM: what
    an ONNX Runtime peer needs to train in a device's container (evaluate/container_peers.py)."""
    _known(arch)
    return [debian_layer(arch), python_layer(arch, ORT_WHEELS, "onnxruntime")]


def executorch_layers(arch: str) -> list[Path]:
    """PyTorch's layers and ExecuTorch's wheel, the versions installed here, no TVM: what an
    ExecuTorch peer needs to train in a device's container (evaluate/container_peers.py)."""
    return [*pytorch_layers(arch), python_layer(arch, EXECUTORCH_WHEELS, "executorch")]


def image_config(arch: str, layers: list[Path], config: dict) -> bytes:
    """The image's config JSON; its sha256 is the image ID."""
    return json.dumps({
        "architecture": ARCHITECTURES[arch][0], "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin",
                           f"PYTHONPATH=/{SITE}", "PYTHONNOUSERSITE=1",
                           "PYTHONDONTWRITEBYTECODE=1"], **config},
        "rootfs": {"type": "layers", "diff_ids": [diff_id(p) for p in layers]},
    }, sort_keys=True, separators=(",", ":")).encode()


def ensure_image(client, arch: str, layers: list[Path], config: dict, repository: str) -> dict:
    """The image of ``layers`` with ``config`` in the engine, loaded if it is not there yet;
    tagged ``repository:<first 12 hex digits of its ID>``. Returns its ID, tag and layers."""
    import docker

    body = image_config(arch, layers, config)
    ident = "sha256:" + hashlib.sha256(body).hexdigest()
    tag = f"{repository}:{ident[7:19]}"
    try:
        client.images.get(ident)
    except docker.errors.ImageNotFound:
        with tempfile.TemporaryFile(dir=CACHE if CACHE.exists() else None) as archive:
            _write_archive(archive, body, layers, tag)
            archive.seek(0)
            loaded = client.images.load(archive)
        if [image.id for image in loaded] != [ident]:
            raise RuntimeError(f"docker load gave {[i.id for i in loaded]}, expected {ident}")
    client.images.get(ident).tag(*tag.split(":"))
    return {"id": ident, "tag": tag, "architecture": ARCHITECTURES[arch][0],
            "layers": [{"file": p.name, "diff_id": diff_id(p),
                        "bytes": p.stat().st_size} for p in layers]}


def _write_archive(handle, config: bytes, layers: list[Path], tag: str) -> None:
    """A `docker load` archive: the config, one directory per layer and manifest.json."""
    def add(tar, name, data=None, path=None):
        info = tarfile.TarInfo(name)
        info.size = len(data) if data is not None else Path(path).stat().st_size
        if data is not None:
            tar.addfile(info, io.BytesIO(data))
        else:
            with open(path, "rb") as layer:
                tar.addfile(info, layer)

    config_name = hashlib.sha256(config).hexdigest() + ".json"
    names = [f"{diff_id(p)[7:]}/layer.tar" for p in layers]
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": names}]
    with tarfile.open(fileobj=handle, mode="w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, config_name, data=config)
        for name, path in zip(names, layers):
            add(tar, name, path=path)
        add(tar, "manifest.json", data=json.dumps(manifest).encode())


class OutOfMemory(Exception):
    """The container went over the profile's memory and the kernel killed it."""


def run_limited(client, image: str, command: list[str], profile, mounts: dict,
                timeout_s: float) -> str:
    """Run ``command`` in ``image`` limited to the profile's cores and memory (no swap, no
    network); ``mounts`` maps host paths to (container path, mode). Returns the logs; raises
    OutOfMemory if the kernel killed it for memory, RuntimeError if it failed, TimeoutError
    past ``timeout_s``."""
    import requests

    cores, memory = int(profile.cores), int(profile.memory_mb)
    if cores > (os.cpu_count() or 1):
        raise ConfigError(f"{profile.source}: cores={cores}, but this "
                          f"machine has {os.cpu_count()}; a container cannot be given more "
                          f"(allowed: 1 to {os.cpu_count()})")
    container = client.containers.create(
        image, command, detach=True, network_mode="none", network_disabled=True,
        nano_cpus=cores * 10**9, cpuset_cpus=f"0-{cores - 1}",
        mem_limit=f"{memory}m", memswap_limit=f"{memory}m",  # equal: no swap
        # OpenBLAS on one thread: the step splits its products over TVM's pool, and the
        # threads OpenBLAS otherwise starts when it loads slow the step (pipelines/backend/cpu_schedules.py).
        environment={"TVM_NUM_THREADS": str(cores), "OMP_NUM_THREADS": str(cores),
                     "OPENBLAS_NUM_THREADS": "1"},
        volumes={str(host): {"bind": inside, "mode": mode}
                 for host, (inside, mode) in mounts.items()})
    try:
        container.start()
        try:
            status = container.wait(timeout=timeout_s)
        except requests.exceptions.ConnectionError as err:  # the SDK's read timeout
            raise TimeoutError(f"container of {image}: over {timeout_s:.0f} s") from err
        container.reload()
        logs = container.logs().decode(errors="replace")
        # Docker sets OOMKilled from an event that cgroup v2 hosts can miss; nothing but the
        # kernel sends SIGKILL (exit 137) to a container we only wait on.
        if container.attrs["State"]["OOMKilled"] or status["StatusCode"] == 137:
            raise OutOfMemory(f"killed for memory (exit {status['StatusCode']}): over "
                              f"memory_mb={memory} ({profile.name}'s memory)\n{logs[-2000:]}")
        if status["StatusCode"] != 0:
            raise RuntimeError(f"container of {image} exited with {status['StatusCode']}:\n"
                               f"{logs[-3000:]}")
        return logs
    finally:
        container.remove(force=True)
