"""The native runner (native_runner.cc): a C++ program linked against TVM's runtime library only
that fine-tunes with a built step, no Python on the device. Built per device with the profile's
toolchain (the host's g++, or Debian's cross compiler), beside the runtime libraries of the
device's architecture (from the apache-tvm and apache-tvm-ffi wheels of the versions installed
here); a foreign one runs under qemu in the emulated device's root.

What it runs is a step directory (``step_directory``): the build's step.so and the libraries
beside it, runner.json (the step's device, data inputs, state, updates and the source's names) and
state.safetensors (the start: weights, and the optimizer state at zero). Data goes in as
train.safetensors, one tensor per data input of the step; weights come out as safetensors.
CompiledStep (step.py) stays the runner of development and tests; both give the same weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pipelines.io import write_json_atomic
from pipelines.runtime.device_io import libraries_beside
from pipelines.runtime.emulation import device_architecture, emulation_root, install_wheels
from pipelines.runtime.images import CACHE  # its parent: pockengine's cache
from pipelines.runtime.step import initial_state
from pipelines.schema import ConfigError
from pipelines.stored_weights import SCALES, scale_name

SOURCE = Path(__file__).with_name("native_runner.cc")
PYTHON_RUNNER = Path(__file__).with_name("python_runner.py")
RUNTIME = ["libtvm_runtime.so", "libtvm_ffi.so"]  # all the runner and a CPU step need of TVM
CUDA_RUNTIME = "libtvm_runtime_cuda.so"  # and a GPU step (it links the CUDA runtime)
EXIT_CODES = {2: "bad input", 3: "a step's loss or new state is not finite"}


def data_manifest(signature: dict) -> dict:
    """The batch size and the step's data inputs. A data input's ``example`` is one example's
    shape as the data holds it ([N, *example]): a language model's labels, which the step
    takes flattened, [batch x sequence], are [N, sequence]."""
    types = [signature["data_types"][n] for n in signature["data"]]
    batch = types[0]["shape"][0]
    return {"batch": batch,
            "data": [{"name": n, **t, "example": (t["shape"][1:] if t["shape"][0] == batch
                                                  else [t["shape"][0] // batch, *t["shape"][1:]])}
                     for n, t in zip(signature["data"], types)]}


def manifest(signature: dict, state: dict[str, np.ndarray], built: dict) -> dict:
    """runner.json: the step's device and whether its state must stay in the tensors it
    captured (``built``: its build.json), what the runner needs of the step's signature, and
    the dtype and shape of each entry of its ``state``, which the runners check once, as the
    data (the built step does not: backend/checked_once.py)."""
    labels = signature.get("labels") or {}
    return {"device": "cuda" if json.loads(built["target"])["kind"] == "cuda" else "cpu",
            "resident": bool(built.get("cuda_graph")),
            **data_manifest(signature),
            "labels": ({"name": "labels", **labels}
                       if labels.get("classes") and "labels" in signature["data"] else None),
            "state": [{"name": n, "dtype": str(state[n].dtype), "shape": list(state[n].shape)}
                      for n in signature["inputs"][len(signature["data"]):]],
            "updates": [n.removeprefix("new_") for n in signature["outputs"][1:]],
            "weights": weight_names(signature)}


def weight_names(signature: dict) -> dict[str, str]:
    """The source's name for each weight the runners write out, by the step's: the parameters
    and buffers, and beside a weight stored as int8 its rows' scales (``<source name>__scale``:
    a frozen weight goes out as the step stored it)."""
    names = signature["source_names"]
    return names | {scale: scale_name(names[n]) for n, scale in signature.get(SCALES, {}).items()}


def step_directory(build_dir: Path, initial: dict[str, np.ndarray], out: Path) -> Path:
    """``out`` as the runner's step directory for the build in ``build_dir`` starting from
    ``initial`` (parameters and buffers by the step's names)."""
    signature = json.loads((Path(build_dir) / "signature.json").read_text())
    built = json.loads((Path(build_dir) / "build.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for library in [Path(build_dir) / "step.so", *libraries_beside(Path(build_dir) / "step.so")]:
        shutil.copyfile(library, out / library.name)
    state = initial_state(signature, initial)
    write_json_atomic(out / "runner.json", manifest(signature, state, built))
    save_file(state, str(out / "state.safetensors"))
    return out


def save_data(path: Path, signature: dict, arrays: tuple[np.ndarray, ...]) -> None:
    """train.safetensors at ``path``: the step's data inputs (as the step takes them, any
    number of batches), each [N, *example] (``manifest``)."""
    shapes = {d["name"]: d for d in data_manifest(signature)["data"]}
    save_file({name: np.ascontiguousarray(a, shapes[name]["dtype"]).reshape(
        -1, *shapes[name]["example"]) for name, a in zip(signature["data"], arrays)}, str(path))


def runtime_libraries(arch: str, cuda: bool = False) -> list[Path]:
    """libtvm_runtime.so and libtvm_ffi.so for ``arch`` (and TVM's CUDA runtime where
    ``cuda``): the installed ones for this machine's, else from the device's wheels (cached
    under ~/.cache/pockengine)."""
    if arch == os.uname().machine:
        import tvm
        import tvm_ffi

        roots = [Path(tvm.__file__).parent, Path(tvm_ffi.__file__).parent]
    else:
        wheels = {w: version(w) for w in ("apache-tvm", "apache-tvm-ffi")}
        key = hashlib.sha256(json.dumps([arch, wheels]).encode()).hexdigest()[:16]
        site = CACHE.parent / f"runtime-{arch}-{key}"
        if not site.exists():
            with tempfile.TemporaryDirectory(dir=CACHE.parent) as tmp:
                install_wheels(arch, Path(tmp) / "site", list(wheels))
                os.replace(Path(tmp) / "site", site)
        roots = [site / "tvm", site / "tvm_ffi"]
    wanted = RUNTIME + [CUDA_RUNTIME] * cuda
    found = {p.name: p for root in roots for p in (root / "lib").glob("*.so") if p.name in wanted}
    if set(found) != set(wanted):
        raise RuntimeError(f"TVM's runtime libraries for {arch}: found {sorted(found)} of {wanted}")
    return [found[name] for name in wanted]


def build_runner(profile, out: Path) -> Path:
    """The runner for ``profile``'s CPU in ``out`` (``out/runner``), with TVM's runtime
    libraries beside it (found there through its rpath, $ORIGIN; for a GPU profile, TVM's CUDA
    runtime too, which the runner loads for a GPU step). Reproducible: the same source,
    compiler and libraries give the same bytes."""
    import tvm_ffi

    arch = device_architecture(profile, "the native runner")
    cc = profile.toolchain.cc if arch != os.uname().machine else None
    compiler = cc or "g++"
    if shutil.which(compiler) is None:
        raise ConfigError(f"{profile.source}: toolchain.cc {compiler!r} is not on PATH; "
                          f"install the Debian package {profile.toolchain.package or 'g++'} "
                          "(`pock setup` does)")
    out.mkdir(parents=True, exist_ok=True)
    libraries = runtime_libraries(arch, cuda=profile.target["kind"] == "cuda")
    for library in libraries:
        shutil.copyfile(library, out / library.name)
    include = Path(tvm_ffi.__file__).parent / "include"
    subprocess.run([compiler, "-std=c++17", "-O2", "-o", str(out / "runner"), str(SOURCE),
                    f"-I{include}", f"-L{out}", "-Wl,--no-as-needed", "-ltvm_runtime",
                    "-ltvm_ffi", "-Wl,-rpath,$ORIGIN", "-Wl,--build-id=none",
                    # the headers' assertions name their files: not where this checkout is
                    f"-ffile-prefix-map={include}=include",
                    f"-ffile-prefix-map={SOURCE.parent}=."], check=True)
    return out / "runner"


def _run(command: list[str], out_dir: Path, cores: int, timeout_s: float) -> dict:
    """A runner's command on ``cores`` threads; its log in ``out_dir``, or a RuntimeError
    with its exit code's meaning and its message."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, TVM_NUM_THREADS=str(cores)))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:2])} exited with {done.returncode} "
                           f"({EXIT_CODES.get(done.returncode, 'failed')}): {done.stderr[-2000:]}")
    return json.loads((out_dir / "log.json").read_text())


def run_native(runner: Path, step_dir: Path, data_dir: Path, out_dir: Path, profile=None,
               args: tuple[str, ...] = (), timeout_s: float = 900,
               cores: int | None = None) -> dict:
    """Run ``runner`` on a step directory and a data directory, writing into ``out_dir``, on
    ``cores`` threads (default: the profile's, else this machine's); its log. A foreign
    architecture's runner runs under the profile's qemu in its emulated root."""
    command = [str(runner), str(step_dir), "--data", str(data_dir), "--out", str(out_dir), *args]
    if profile is not None and device_architecture(profile, "the native runner") != os.uname().machine:
        command = [profile.emulation.qemu, "-L", str(emulation_root(profile)), *command]
    return _run(command, out_dir, cores or (profile.cores if profile else os.cpu_count()),
                timeout_s)


def run_python(step_dir: Path, data_dir: Path, out_dir: Path, cores: int,
               timeout_s: float = 900, args: tuple[str, ...] = ()) -> dict:
    """The Python runner (python_runner.py) on the same command line, in a process of its own
    (its memory is its own); its log."""
    return _run([sys.executable, str(PYTHON_RUNNER), str(step_dir), "--data", str(data_dir),
                 "--out", str(out_dir), *args], out_dir, cores, timeout_s)
