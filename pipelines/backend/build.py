"""Compiling a training step for a device profile and linking it with the profile's toolchain.

- ``shared``: a .so linked here with ``toolchain.cc`` (null: TVM's default host compiler), e.g.
  Debian's aarch64-linux-gnu-g++ for Linux aarch64 boards;
- ``archive``: a .tar of the object files, for targets no linker here can finish (Android
  without the NDK, macOS); the device links them (`clang -shared *.o`, or TVM's RPC server does
  it on upload). Written deterministically: sorted names, zero times and owners.

GPU targets get their kernels scheduled (gpu.py); CUDA kernels are compiled here by nvcc
(cuda.py). Every compiled step anything runs is built here, by the build stages.
"""
from __future__ import annotations

import contextlib
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import tvm
from tvm import relax

from pipelines.backend.arena_plan import arena_plan
from pipelines.backend.blas import (compile_with_backends, library_products, link_libraries,
                                    switch_backends)
from pipelines.backend.checked_once import drop_param_checks
from pipelines.backend.cuda import NVCC_PACKAGE, nvcc_version, pack_imports_with_fatbin
from pipelines.backend.gpu import GPU_KINDS, gpu_pipeline
from pipelines.backend.cpu_schedules import schedule_cpu
from pipelines.profiles import tvm_target
from pipelines.schema import ConfigError
from pipelines.transform import EmptyConstantsAsZeros

LIBRARY = {"shared": "step.so", "archive": "step.tar"}


def write_archive(output: str, objects: list[str], options=None) -> None:
    with tarfile.open(output, "w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(objects, key=lambda p: Path(p).name):
            info = tar.gettarinfo(path, arcname=Path(path).name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o644
            with open(path, "rb") as handle:
                tar.addfile(info, handle)


def check_toolchain(profile) -> None:
    """Refuse before compiling when a tool the profile needs is missing, naming the package."""
    toolchain, cc = profile.toolchain, profile.toolchain.cc
    if toolchain.output == "shared" and cc and shutil.which(cc) is None:
        package = toolchain.package or "the package that provides it"
        raise ConfigError(f"{profile.source}: toolchain.cc={cc!r} is not on PATH; install the "
                          f"Debian package {package} (apt-get install {package})")
    if profile.target["kind"] == "cuda" and shutil.which("nvcc") is None:
        raise ConfigError(f"{profile.source}: target kind 'cuda' compiles kernels with nvcc, "
                          f"which is not on PATH; install {NVCC_PACKAGE}")


# The CPU build's Relax pipeline: TVM's default (relax.get_pipeline("default"), 0.27) with the
# planned tensors placed in one arena by their lifetimes (arena_plan.py) and the per-call
# parameter checks dropped (checked_once.py). PLANNED: its passes that plan memory, which the
# memory plan runs on the optimized (legalized) step (compile.py: PLAN).
PLANNED = [
    relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
    relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
    relax.transform.StaticPlanBlockMemory(), arena_plan,
]
CPU_PIPELINE = tvm.transform.Sequential([
    relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(),
    relax.transform.LegalizeOps()] + PLANNED + [
    relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse(),
    relax.transform.LowerRuntimeBuiltin(), relax.transform.ComputePrimValue(),
    relax.transform.VMShapeLower(), relax.transform.AttachGlobalSymbol(), drop_param_checks,
])


def build_step(mod: tvm.IRModule, profile, directory: Path, database=None,
               inputs: int | None = None) -> dict:
    """Compile ``mod`` for ``profile`` into ``directory``; returns what the manifest records.
    A CPU kernel with a record in ``database`` (a tuning database, backend/databases.py) takes
    its tuned schedule, the others the default one. ``inputs``: how many of ``train_step``'s
    leading parameters change between calls (the batch); the rest, its state, stays resident,
    which is what a profile's ``cuda_graph`` needs to know."""
    check_toolchain(profile)
    target = tvm_target(profile)
    mod = EmptyConstantsAsZeros()(mod)  # TVM's executable cannot load them back
    toolchain, kernels, launches, cuda = profile.toolchain, Counter(), Counter(), {}
    config = {}
    if target.kind.name in GPU_KINDS:
        # The profile's library takes the float32 products; the other gemm kernels stay as
        # they are, transposes folded in: the GPU rules schedule them.
        rows = library_products(mod, profile.gemm_library) if profile.gemm_library else {}
        choice = {name: row["backend"] for name, row in rows.items()}
        mod = switch_backends(mod, choice, split=False)
        options = link_libraries(Path(directory), set(choice.values()), toolchain.cc)
        pipeline = gpu_pipeline(target, kernels, launches)
        backends = {"measured": False, "kernels": rows, "reason": (
            f"gemm_library {profile.gemm_library}: chosen by the profile (no GPU on the build "
            f"host to time them on)" if rows else "every product generated")}
        if profile.cuda_graph:
            mod, config = resident_state(mod, inputs), {"relax.backend.use_cuda_graph": True}
    else:
        # Matrix products on OpenBLAS where measured faster; only a device whose code runs on
        # this machine's CPU (runner local or docker) can be measured, elsewhere they stay
        # generated.
        measured = profile.runs_here
        mod, options, rows = compile_with_backends(mod, target, Path(directory), measured)
        backends = {"measured": measured, "kernels": rows} if measured else {
            "measured": False, "reason": f"runner {profile.runner}: the build cannot time "
                                         f"kernels on the device; every product generated"}
        (mod, kernels), pipeline = schedule_cpu(mod, target, database), CPU_PIPELINE
    with tvm.transform.PassContext(config=config) if config else contextlib.nullcontext():
        executable = tvm.compile(mod, target=target, relax_pipeline=pipeline)
    library = Path(directory) / LIBRARY[toolchain.output]
    if toolchain.output == "archive":
        options["fcompile"] = write_archive
    elif toolchain.cc:
        from tvm.support import cc

        options["fcompile"] = cc.cross_compiler(toolchain.cc)
    if target.kind.name == "cuda":
        options["fpack_imports"] = pack_imports_with_fatbin(str(target.attrs["arch"]), cuda)
        cuda.update(nvcc=nvcc_version(), arch=str(target.attrs["arch"]))
    executable.export_library(str(library), **options)
    return {
        "library": library.name, "library_bytes": library.stat().st_size,
        "output": toolchain.output, "cc": toolchain.cc or "TVM default (g++)",
        "links_on_device": toolchain.output == "archive",
        "target": str(target),
        **({"kernel_schedules": dict(sorted(kernels.items()))} if kernels else {}),
        **({"backends": backends} if backends else {}),
        **({"cuda": cuda} if cuda else {}),
        **({"kernel_launches": dict(sorted(launches.items()))} if launches else {}),
        **({"cuda_graph": True} if config else {}),
    }


def resident_state(mod: tvm.IRModule, inputs: int | None) -> tvm.IRModule:
    """``train_step`` marked with how many parameters are its batch (``num_input``): TVM's
    RewriteCUDAGraph captures the kernels that read only the rest (the state, passed as the
    same tensors every call) and the statically planned storage into CUDA graphs, replayed
    from the second call on. The kernels that read the batch are launched as usual."""
    if inputs is None:
        raise ValueError("a CUDA-graph build needs the number of the step's batch inputs")
    functions = dict(mod.functions_items())
    step = mod.get_global_var("train_step")
    functions[step] = functions[step].with_attr("num_input", inputs)
    return tvm.IRModule(functions, attrs=mod.attrs)
