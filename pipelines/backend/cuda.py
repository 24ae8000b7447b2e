"""CUDA device code compiled here with nvcc, shipped as a fatbin inside the step library.

The apache-tvm wheel has no CUDA runtime, so its codegen keeps each CUDA kernel module as
source (format "cuda"), which a CUDA-enabled TVM runtime would compile at load time with NVRTC.
Instead, the source is compiled ahead of time with nvcc for the profile's ``arch`` and the
module's payload rewritten to format "fatbin", which the device's CUDA loader takes as it is.
That rewrite reads TVM 0.27's library serialization (pinned in pyproject.toml):

  blob    = u64 size, u64[] import-tree row pointers, u64[] child indices, then per module:
            str kind, and unless kind is "_lib", str payload
  payload = str format, u64 count x (str key, FunctionInfo), str code      (a CUDA module)
  FunctionInfo = str name, u64 n + n x 4-byte DLDataType, u64 n + n x str, u64 n + n x int32
  str     = u64 length + bytes (all little-endian)
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import tvm

NVCC_PACKAGE = "nvidia-cuda-toolkit (or NVIDIA's CUDA toolkit with nvcc on PATH)"


class _Reader:
    def __init__(self, data: bytes, offset: int = 0):
        self.data, self.offset = data, offset

    def u64(self) -> int:
        (value,) = struct.unpack_from("<Q", self.data, self.offset)
        self.offset += 8
        return value

    def bytes(self) -> bytes:
        size = self.u64()
        self.offset += size
        return self.data[self.offset - size:self.offset]

    def skip(self, count: int, item_size: int) -> None:
        self.offset += count * item_size


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _split_cuda_payload(payload: bytes) -> tuple[bytes, bytes, bytes]:
    """(format, function map bytes, code) of a CUDA module's payload."""
    reader = _Reader(payload)
    fmt = reader.bytes()
    start = reader.offset
    for _ in range(reader.u64()):
        reader.bytes()                      # key
        reader.bytes()                      # FunctionInfo.name
        reader.skip(reader.u64(), 4)        # arg_types
        for _ in range(reader.u64()):       # launch_param_tags
            reader.bytes()
        reader.skip(reader.u64(), 4)        # arg_extra_tags
    fmap = payload[start:reader.offset]
    code = reader.bytes()
    if reader.offset != len(payload):
        raise RuntimeError("CUDA module payload not in TVM 0.27's layout; check the TVM pin")
    return fmt, fmap, code


def nvcc_fatbin(source: bytes, arch: str) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError(f"nvcc not found on PATH: CUDA targets compile device code with "
                                f"it; install {NVCC_PACKAGE}")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "step.cu", Path(tmp) / "step.fatbin"
        src.write_bytes(source)
        subprocess.run([nvcc, "--fatbin", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                       check=True, capture_output=True, text=True)
        return out.read_bytes()


def nvcc_version() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out else "unknown"


def fatbin_blob(mod, arch: str) -> tuple[bytes, dict]:
    """The library blob of ``mod`` with every CUDA source module compiled to a fatbin by nvcc;
    and what was compiled (for the manifest)."""
    blob = tvm.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes()
    reader = _Reader(blob)
    if reader.u64() != len(blob) - 8:
        raise RuntimeError("library blob not in TVM 0.27's layout; check the TVM pin")
    rows = [reader.u64() for _ in range(reader.u64())]
    reader.skip(reader.u64(), 8)
    head, out, info = blob[8:reader.offset], [], {"kernels_bytes": 0, "fatbin_bytes": 0}
    for _ in range(len(rows) - 1):
        kind = reader.bytes()
        out.append(_string(kind))
        if kind == b"_lib":
            continue
        payload = reader.bytes()
        if kind == b"cuda":
            fmt, fmap, code = _split_cuda_payload(payload)
            if fmt == b"cuda":  # source: compile it here
                fatbin = nvcc_fatbin(code, arch)
                info["kernels_bytes"] += len(code)
                info["fatbin_bytes"] += len(fatbin)
                payload = _string(b"fatbin") + fmap + _string(fatbin)
        out.append(_string(payload))
    body = head + b"".join(out)
    return struct.pack("<Q", len(body)) + body, info


def pack_imports_with_fatbin(arch: str, info: dict):
    """An ``fpack_imports`` for ``export_library``: the imports as a C array (the symbol TVM's
    loader looks for), CUDA kernels precompiled."""
    def pack(mod, is_system_lib, prefix, workspace_dir):
        if is_system_lib:
            raise RuntimeError("CUDA fatbin packing supports shared libraries only")
        blob, compiled = fatbin_blob(mod, arch)
        info.update(compiled)
        rows = ",\n".join(",".join(f"0x{b:02x}" for b in blob[i:i + 32])
                          for i in range(0, len(blob), 32))
        path = Path(workspace_dir) / f"{prefix}devc.c"
        path.write_text(
            '#ifdef __cplusplus\nextern "C" {\n#endif\n'
            f"extern const unsigned char {prefix}__tvm_ffi__library_bin[];\n"
            f"const unsigned char {prefix}__tvm_ffi__library_bin[{len(blob)}] = {{\n{rows}\n}};\n"
            "#ifdef __cplusplus\n}\n#endif\n")
        return str(path)

    return pack
