"""TVM's CUDA runtime in this process, for a step built for an NVIDIA GPU, and how such a step's
state is kept between calls (the Python runners: step.py and python_runner.py; the native
runner does both itself)."""
from __future__ import annotations

import tvm


def cuda_device():
    """The first NVIDIA GPU, with TVM's CUDA runtime (libtvm_runtime_cuda.so, beside
    libtvm_runtime.so) loaded; PyTorch, imported first, has loaded the CUDA runtime it needs.
    A machine without one is a RuntimeError saying so."""
    import ctypes

    from tvm.libinfo import package_lib_paths

    if not tvm.get_global_func("device_api.cuda", allow_missing=True):
        try:  # where PyTorch has not loaded it, the CUDA toolkit's (ldconfig knows it)
            ctypes.CDLL("libcudart.so.13", ctypes.RTLD_GLOBAL)
        except OSError:
            pass
        found = [p / "libtvm_runtime_cuda.so" for p in package_lib_paths()
                 if (p / "libtvm_runtime_cuda.so").exists()]
        if not found:
            raise RuntimeError("libtvm_runtime_cuda.so is not beside libtvm_runtime.so")
        ctypes.CDLL(str(found[0]), ctypes.RTLD_GLOBAL)
    device = tvm.cuda(0)
    if not device.exist:
        raise RuntimeError("no NVIDIA GPU on this machine (TVM's CUDA runtime finds none)")
    return device


def keep(state: dict, name: str, value, resident: bool) -> None:
    """State entry ``name`` takes ``value``, a new value the step gave it. A step replaying
    CUDA graphs (``resident``: build.json's ``cuda_graph``) reads its state from the tensors
    it captured on its first call: a new value is copied into them, never put in their
    place."""
    if not resident:
        state[name] = value
    elif not state[name].same_as(value):
        state[name].copyfrom(value)
