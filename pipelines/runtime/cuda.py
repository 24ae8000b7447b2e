"""TVM's CUDA runtime in this process, for a step built for an NVIDIA GPU (the Python runners:
step.py and python_runner.py; the native runner loads the same library itself)."""
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
