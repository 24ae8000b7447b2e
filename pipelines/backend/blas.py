"""Backend switching (the paper's): each matrix product of the step (a ``gemm_<XY>`` kernel,
pipelines/transform/isolate_gemms.py) runs either as generated code or on OpenBLAS (scipy-openblas32 from
PyPI), whichever a measurement on the device finds faster.

- generated: the operands a kernel reads transposed are transposed first, by kernels of their
  own, and the product is the plain ``gemm_nn``, which the default schedules vectorise well (a
  transpose folded into the product's reads made the llama_tiny step 1.6x slower);
- openblas: ``R.call_dps_packed("pockengine_sgemm_<XY>", ...)`` (``..._<XY>_bf16`` or
  ``..._<XY>_i8`` where the second operand is a frozen weight stored as bfloat16, or as int8
  with its rows' scales a third),
  implemented in ``openblas_sgemm.cc``;
  compiled and linked into the step's library, with OpenBLAS's shared library beside it
  (found through the rpath ``$ORIGIN``). The Relax VM calls it directly.

Only a device the build can measure (pipelines/profiles.py: runs_here; runner local or docker,
this machine's CPU) is switched; for the others every product stays generated, and the
manifest says why. A GPU profile's ``gemm_library`` is the exception: there is no GPU here to
measure on, so the profile chooses cuBLAS (``pockengine_cublas_sgemm_<XY>``, in
``cublas_sgemm.cc``) for every float32 product and every int8 weight's (read widened to a
float32 copy), and a bfloat16 weight's products stay kernels the GPU rules schedule as they are
(library_products).
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, te, tirx, topi

from pipelines.backend.cpu_schedules import with_cpu_schedules
from pipelines.backend.cublas import cublas_object
from pipelines.ir import dtype_of
from pipelines.layout import OPENBLAS_LIB
from pipelines.kernels.gemm import GEMM, SCALE_AXIS, gemm_kernel, widen_kernel
from pipelines.timing import step_times

SHIM = Path(__file__).with_name("openblas_sgemm.cc")
# OpenBLAS is chosen for a product only when it is this much faster: close calls stay
# generated, so a rebuild on a noisy machine rarely flips a choice.
MARGIN = 1.1
REPEATS = 20
# A side whose first timed call is this many times the other's median has lost: it is not
# timed 20 times more (an untuned LM head's product took 8.5 s a call against OpenBLAS's 0.4 s,
# three minutes of every Qwen2.5-0.5B build).
DECIDED = 10


def gemm_kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: func for gv, func in mod.functions.items()
            if isinstance(func, tirx.PrimFunc) and GEMM in (func.attrs or {})}


def _operand_shapes(func: tirx.PrimFunc) -> list[list[int]]:
    return [[int(d) for d in p.shape] for p in func.params]


def _operand_dtypes(func: tirx.PrimFunc) -> list[str]:
    return [str(p.dtype) for p in func.params]


def _tensor(values: np.ndarray, dtype: str, device):
    """float32 ``values`` as a tensor of ``dtype``."""
    if dtype == "bfloat16":
        import ml_dtypes
        return tvm.runtime.tensor(values.astype(ml_dtypes.bfloat16), device)
    return tvm.runtime.tensor(values.astype(dtype), device)


def openblas_function(func: tirx.PrimFunc) -> str:
    """The shim's function for gemm kernel ``func``."""
    suffix = {"bfloat16": "_bf16", "int8": "_i8"}.get(_operand_dtypes(func)[1], "")
    return f"pockengine_sgemm_{func.attrs[GEMM]}{suffix}"


def cublas_function(func: tirx.PrimFunc) -> str:
    """cublas_sgemm.cc's function for float32 gemm kernel ``func``."""
    return f"pockengine_cublas_sgemm_{func.attrs[GEMM]}"


# A library backend: its shim's function for a gemm kernel
LIBRARIES = {"openblas": openblas_function, "cublas": cublas_function}
# The libraries whose shim reads a bfloat16 or int8 second operand itself; the others read it
# widened to float32 first (kernels/gemm.py: widen_kernel)
READS_STORED = {"openblas"}


@functools.cache
def _scratch() -> Path:
    """This process's scratch directory for the shim, removed when the process exits."""
    scratch = tempfile.TemporaryDirectory(prefix="pock-openblas-")
    _SCRATCH.append(scratch)  # held, so that it lives as long as the process
    return Path(scratch.name)


_SCRATCH: list = []


@functools.cache
def shim_object() -> Path:
    """The compiled ``openblas_sgemm.cc`` (once per process)."""
    import scipy_openblas32
    import tvm_ffi

    tvm_include = Path(tvm.__file__).parent / "include"  # c_backend_api.h: the thread pool
    out = _scratch() / "openblas_sgemm.o"
    # The headers' check macros embed __FILE__: map the checkout and site-packages away so a
    # step library is the same bytes whichever directory it was built in.
    site_packages = Path(tvm_ffi.__file__).parents[1]
    command = ["g++", "-c", "-fPIC", "-O3", "-std=c++17",  # -O3: the widening vectorised
               f"-ffile-prefix-map={SHIM.parent}=pipelines",
               f"-ffile-prefix-map={site_packages}=site-packages",
               f"-I{tvm_ffi.libinfo.find_include_path()}",
               f"-I{tvm_include}", f"-I{scipy_openblas32.get_include_dir()}", str(SHIM), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{SHIM}: g++ failed:\n{done.stderr}")
    return out


def link_openblas(directory: Path) -> dict:
    """``export_library`` options that link the shim and OpenBLAS into ``directory``'s step
    library; OpenBLAS's shared library is copied beside it."""
    import scipy_openblas32

    shutil.copyfile(Path(scipy_openblas32.get_lib_dir()) / OPENBLAS_LIB,
                    Path(directory) / OPENBLAS_LIB)
    return {"addons": [str(shim_object())],
            # --no-as-needed: the library must be recorded as needed even though the linker,
            # reading it before the objects that call it, would otherwise drop it.
            "options": [f"-L{directory}", "-Wl,--no-as-needed", "-lscipy_openblas",
                        "-Wl,-rpath,$ORIGIN"]}


@functools.cache
def _openblas_module():
    """The shim as a library of its own, for measuring."""
    directory = _scratch() / "measure"
    directory.mkdir()
    options = link_openblas(directory)
    library = directory / "shim.so"
    subprocess.run(["g++", "-shared", "-o", str(library), *options["addons"],
                    *options["options"]], check=True, capture_output=True)
    return tvm.runtime.load_module(str(library))


def _time(function, args, lost_ms: float = float("inf")) -> float:
    """Median milliseconds of ``function(*args)`` after one untimed call; the first timed call
    alone where it already took ``lost_ms`` or more."""
    first = step_times(lambda: function(*args), 1, 1)
    if first[0] >= lost_ms:
        return first[0]
    return float(np.median(first + step_times(lambda: function(*args), 0, REPEATS - 1)))


def _transpose_kernel(shape: list[int], dtype: str) -> tirx.PrimFunc:
    x = te.placeholder(shape, dtype, "x")
    axes = [*range(len(shape) - 2), len(shape) - 1, len(shape) - 2]
    return te.create_prim_func([x, topi.transpose(x, axes)]).without_attr("global_symbol")


def _swapped(shape: list[int]) -> list[int]:
    return [*shape[:-2], shape[-1], shape[-2]]


def generated_parts(func: tirx.PrimFunc) -> list[tuple[tirx.PrimFunc, list[int]]]:
    """The kernels that compute ``func`` as generated code: the transposes of the operands it
    reads transposed, then ``gemm_nn`` (with the same scales: their axis is the output's or the
    summed one either way); each with the operands it reads."""
    trans, scale_axis = str(func.attrs[GEMM]), (func.attrs or {}).get(SCALE_AXIS)
    a, b = _operand_shapes(func)[:2]
    dtypes = _operand_dtypes(func)
    parts = [(_transpose_kernel(shape, dtypes[i]), [i])
             for i, (shape, t) in enumerate(zip((a, b), trans)) if t == "t"]
    plain = [_swapped(s) if t == "t" else s for s, t in zip((a, b), trans)]
    product = gemm_kernel(plain[0], plain[1], "nn", dtypes[1],
                          None if scale_axis is None else str(scale_axis))
    return parts + [(product, [0, 1] if scale_axis is None else [0, 1, 2])]


def measure(mod: tvm.IRModule, target) -> dict[str, dict]:
    """Per gemm kernel: its shapes, generated and OpenBLAS milliseconds on this machine, and
    the backend chosen."""
    device, rng, rows = tvm.cpu(), np.random.default_rng(0), {}
    blas = _openblas_module()
    for name, func in sorted(gemm_kernels(mod).items()):
        trans = str(func.attrs[GEMM])
        shapes = _operand_shapes(func)
        operands = [_tensor(rng.standard_normal(s, dtype=np.float32), dtype, device)
                    for s, dtype in zip(shapes, _operand_dtypes(func))]  # a, b, (scales,) c
        openblas = _time(blas[openblas_function(func)], operands)
        generated = 0.0
        for part, _ in generated_parts(func):
            scheduled, _ = with_cpu_schedules(tvm.IRModule({"main": part.with_attr(
                "global_symbol", "main")}), target)
            kernel = tvm.compile(scheduled, target=target)["main"]
            ins = [_tensor(np.zeros(s, np.float32), dtype, device)
                   for s, dtype in zip(_operand_shapes(part), _operand_dtypes(part))]
            generated += _time(kernel, ins, DECIDED * MARGIN * openblas)
        rows[name] = {"shapes": shapes, "transposed": trans, "generated_ms": generated,
                      "openblas_ms": openblas,
                      "backend": "openblas" if openblas * MARGIN < generated else "generated"}
    return rows


@relax.expr_functor.mutator
class _Switch(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, backends: dict[str, str], split: bool):
        super().__init__(mod)
        self.mod, self.backends, self.split, self.added = mod, backends, split, {}

    def _add(self, func: tirx.PrimFunc, name: str):
        key = (name, *((tuple(int(d) for d in p.shape), str(p.dtype)) for p in func.params))
        if key not in self.added:
            self.added[key] = self.builder_.add_func(func, name)
        return self.added[key]

    def _widened(self, weight, *scales):
        """The float32 copy of a stored ``weight`` (times its rows' ``scales`` where given)."""
        shape = [int(d) for d in weight.ty.shape]
        kernel = widen_kernel(shape, dtype_of(weight), bool(scales))
        return self.builder_.emit(relax.call_tir(self._add(kernel, "widen_operand"),
                                                 [weight, *scales],
                                                 relax.TensorType(shape, "float32")))

    def visit_call_(self, original):
        call = super().visit_call_(original)
        if getattr(call.op, "name", "") != "relax.call_tir":
            return call
        name = call.args[0].name_hint
        func = self.mod[call.args[0]]
        if not isinstance(func, tirx.PrimFunc) or GEMM not in (func.attrs or {}):
            return call
        operands = list(call.args[1].fields)
        backend = self.backends.get(name)
        if backend in LIBRARIES:
            if backend not in READS_STORED and dtype_of(operands[1]) != "float32":
                operands = [operands[0], self._widened(*operands[1:])]
            return relax.call_dps_packed(LIBRARIES[backend](func), operands, original.ty)
        if not self.split:
            return call
        *transposes, (product, _) = generated_parts(func)
        for kernel, (index,) in transposes:
            shape = _swapped([int(d) for d in operands[index].ty.shape])
            operands[index] = self.builder_.emit(relax.call_tir(
                self._add(kernel, "transpose_operand"), [operands[index]],
                relax.TensorType(shape, dtype_of(operands[index]))))
        return relax.call_tir(self._add(product, "gemm_nn"), operands, original.ty)


def switch_backends(mod: tvm.IRModule, backends: dict[str, str],
                    split: bool = True) -> tvm.IRModule:
    """``mod`` with each gemm kernel call on its backend (``backends``: kernel name ->
    "openblas" or "cublas"; any other kernel generated: its transposes split off unless not
    ``split``, for the GPU rules, which schedule the kernel as it is)."""
    mutator = _Switch(mod.clone(), backends, split)  # the builder updates its module in place
    rewritten = {gv.name_hint: mutator.visit_expr(func) for gv, func in mod.functions.items()
                 if isinstance(func, relax.Function)}
    out = mutator.builder_.get()  # the module with the kernels the switch added
    for name, func in rewritten.items():
        out.update_func(out.get_global_var(name), func)
    return relax.transform.DeadCodeElimination()(out)


def compile_with_backends(mod: tvm.IRModule, target, directory: Path,
                          measured: bool) -> tuple[tvm.IRModule, dict, dict]:
    """``mod`` with its gemm kernels on their backends, ready for the CPU build; the options
    ``export_library`` needs to link what it calls; and per kernel what was measured and
    chosen (``measured`` false: every product generated, nothing measured)."""
    rows = measure(mod, target) if measured and gemm_kernels(mod) else {}
    choice = {name: row["backend"] for name, row in rows.items()}
    return switch_backends(mod, choice), link_libraries(directory, choice.values()), rows


def link_libraries(directory: Path, backends, cc: str | None = None) -> dict:
    """``export_library`` options that link the shims of the library ``backends`` named into
    the step library in ``directory`` (``cc``: the compiler for the device's CPU)."""
    options = link_openblas(directory) if "openblas" in backends else {}
    if "cublas" in backends:  # opened by the shim where it runs: nothing to copy or link
        options.setdefault("addons", []).append(str(cublas_object(cc)))
        options.setdefault("options", []).append("-ldl")  # dlopen, outside libc before 2.34
    return options


def library_products(mod: tvm.IRModule, library: str) -> dict[str, dict]:
    """Per gemm kernel of ``mod``: its shapes and ``library`` as its backend. A GPU build
    chooses by its profile: the build host has no GPU to time kernels on. A bfloat16 weight's
    product stays generated (the GPU rules' Matmul schedule reads it as it is); an int8
    weight's, whose scales those rules cannot schedule (dlight's Fallback: a thread per
    output), goes to the library on a float32 copy (``reads``)."""
    rows = {}
    for name, func in sorted(gemm_kernels(mod).items()):
        dtype = _operand_dtypes(func)[1]
        if dtype == "bfloat16":
            continue
        rows[name] = {"shapes": _operand_shapes(func), "transposed": str(func.attrs[GEMM]),
                      "backend": library,
                      **({"reads": f"{dtype}, widened to float32 first"}
                         if dtype != "float32" and library not in READS_STORED else {})}
    return rows
