"""The cuBLAS shim (``cublas_sgemm.cc``) compiled for a step library: a GPU profile's matrix
products on NVIDIA's cuBLAS (backend/blas.py switches them). It is compiled with the device
CPU's compiler and needs no CUDA toolkit: the shim declares the part of cuBLAS's C API it
calls and opens the library where the step runs."""
from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import tvm

SHIM = Path(__file__).with_name("cublas_sgemm.cc")
_SCRATCH: list = []


@functools.cache
def cublas_object(cc: str | None = None) -> Path:
    """``cublas_sgemm.cc`` compiled by ``cc`` (null: g++), once per process, into a scratch
    directory removed when the process exits."""
    import tvm_ffi

    scratch = tempfile.TemporaryDirectory(prefix="pock-cublas-")
    _SCRATCH.append(scratch)  # held, so that it lives as long as the process
    out = Path(scratch.name) / "cublas_sgemm.o"
    # The headers' check macros embed __FILE__: map the checkout and site-packages away so a
    # step library is the same bytes whichever directory it was built in.
    site_packages = Path(tvm_ffi.__file__).parents[1]
    command = [cc or "g++", "-c", "-fPIC", "-O2", "-std=c++17",
               f"-ffile-prefix-map={SHIM.parent}=pipelines",
               f"-ffile-prefix-map={site_packages}=site-packages",
               f"-I{tvm_ffi.libinfo.find_include_path()}",
               f"-I{Path(tvm.__file__).parent / 'include'}", str(SHIM), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{SHIM}: {command[0]} failed:\n{done.stderr}")
    return out
