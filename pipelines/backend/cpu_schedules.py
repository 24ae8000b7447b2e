"""Default CPU schedules: TVM 0.27's llvm pipeline leaves every kernel an unscheduled scalar loop
on one thread (docs/tuning.md, "Default schedules", has what that cost). Without tuning, each kernel of the training
step gets the same simple schedule:

- inline what can be inlined (padding, elementwise producers, epilogues) into the main block,
  except an exponential two blocks read; then simplify the indices the inlined reshapes leave;
- the innermost spatial loop of extent > 1 (the output's contiguous axis once unit loops are
  skipped), split by VECTOR, goes innermost, under the reduction loops, and is vectorised (a
  reduction's: unrolled, for LLVM to vectorise: TVM's vectorize refuses a reduction);
- a row reduction (one reduction axis, contiguous in what it reads, as a softmax's sums) keeps
  VECTOR partial results per row, a vector over contiguous elements, then combines them;
- the other spatial loops are fused and run in parallel on the profile's cores, unless the
  block's loop nest is too small to repay waking the thread pool (SERIAL_WORK);
- a reduction's initialisation is split off (decompose_reduction) above the reduction loops.

Only loop order, splitting and threading change, and a row reduction's order of terms (the
partial results): results differ from the unscheduled build by that and the compiler's vector
code only. A kernel the rule cannot take is left as TVM made it, and counted.

A kernel with a record in a tuning database (databases.py) takes its tuned schedule instead
(``schedule_cpu``); one without, whose anchor block (its convolution or product) has a record,
takes that record's schedule for the anchor block.

This module also sets how a CPU build computes float32 exp and erf: as polynomials, one value or
a vector at a time, instead of libm calls per lane (see the registration below).
"""
from __future__ import annotations

import math
from collections import Counter

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.meta_schedule.trace_apply import schedule_using_anchor_trace
from tvm.s_tir.schedule.schedule import ScheduleError

import pipelines.threads  # noqa: F401  (TVM's and OpenBLAS's thread counts)
from pipelines.backend.databases import best_record, by_anchor_block, workload
from pipelines.kernels.softmax_nll import LOSS_KERNEL, schedule_softmax_nll_loss

VECTOR = 16  # float32 lanes: two AVX2 registers, four NEON ones
# A loop nest of fewer iterations than this runs on one thread: waking TVM's pool costs more
# than splitting so little work saves (docs/tuning.md, "Default schedules").
SERIAL_WORK = 16384


def _f32(value: float, lanes: int = 1):
    constant = tirx.const(value, "float32")
    return constant if lanes == 1 else tirx.Broadcast(constant, lanes)


def _polynomial(x, coefficients, lanes: int):
    """coefficients[0] * x^(n-1) + ... + coefficients[-1], by Horner's rule."""
    result = _f32(coefficients[0], lanes)
    for coefficient in coefficients[1:]:
        result = result * x + _f32(coefficient, lanes)
    return result


def _clamp(x, low: float, high: float, lanes: int):
    """x within [low, high], a NaN left NaN (both comparisons are false for it; min and max
    would return the bound)."""
    above = tirx.Select(x > _f32(high, lanes), _f32(high, lanes), x)
    return tirx.Select(above < _f32(low, lanes), _f32(low, lanes), above)


def _elementwise_float32(compute):
    """An intrinsic lowering: float32 calls, one value or a vector of them (a vectorised loop),
    become ``compute(x, lanes)`` (x bound once); other types keep TVM's rule."""
    def lower(call):
        dtype = call.ty.dtype
        if dtype.with_lanes(1) != "float32":
            return call  # unchanged: the next rule applies
        x = tirx.Var("x", str(dtype))
        return tirx.Let(x, call.args[0], compute(x, dtype.lanes))
    return lower


def _exp(x, lanes: int):
    """Cephes' expf (the form of TVM's topi.fast_exp; PyTorch's SLEEF exp is of the same
    kind): exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2. Relative error within
    2e-7 wherever the result is a normal float; below -88.38 it gives 0 or nearly."""
    c, n, r = (tirx.Var(name, x.ty.dtype) for name in ("c", "n", "r"))
    int32 = "int32" if lanes == 1 else f"int32x{lanes}"
    two_to_n = tirx.reinterpret(x.ty.dtype, tirx.shift_left(  # the exponent bits
        tirx.Cast(int32, n + _f32(127.0, lanes)), tirx.const(23, "int32")))
    exp_r = _polynomial(r, (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                            1.6666665459e-1, 5.0000001201e-1), lanes) * r * r + r + _f32(1.0, lanes)
    return tirx.Let(c, _clamp(x, -88.3762626647949, 88.3762626647950, lanes),
                    tirx.Let(n, tirx.floor(c * _f32(1.44269504088896341, lanes) + _f32(0.5, lanes)),
                             # ln 2 in two parts (Cody and Waite): n * 0.693359375 is exact in
                             # float32, so r keeps its bits even where n is large.
                             tirx.Let(r, c - n * _f32(0.693359375, lanes)
                                      - n * _f32(-2.12194440e-4, lanes), exp_r * two_to_n)))


def _erf(x, lanes: int):
    """Eigen's float erf (TVM's topi.fast_erf): a rational function of x on [-4, 4], +-1
    beyond. Absolute error within 4e-7 (libm's: 6e-8)."""
    c, c2 = tirx.Var("c", x.ty.dtype), tirx.Var("c2", x.ty.dtype)
    numerator = _polynomial(c2, (-2.72614225801306e-10, 2.77068142495902e-08,
                                 -2.10102402082508e-06, -5.69250639462346e-05,
                                 -7.34990630326855e-04, -2.95459980854025e-03,
                                 -1.60960333262415e-02), lanes)
    denominator = _polynomial(c2, (-1.45660718464996e-05, -2.13374055278905e-04,
                                   -1.68282697438203e-03, -7.37332916720468e-03,
                                   -1.42647390514189e-02), lanes)
    return tirx.Let(c, _clamp(x, -4.0, 4.0, lanes),
                    tirx.Let(c2, c * c, c * numerator / denominator))


# exp and erf of float32 on a CPU as polynomials LLVM vectorises: TVM's llvm rules call libm
# once per vector lane, several times slower (docs/tuning.md, "Vectorised exp and erf"). A
# vectorised loop's exp is lowered on its vectors (TVM's rule has no vector form). Every CPU
# build in a process that imports this module (see the environment above) lowers them so, the
# tuning's candidates included: what is tuned is what is built.
tirx.register_intrin_lowering("tirx.exp", target="llvm", f=_elementwise_float32(_exp), level=100)
tirx.register_intrin_lowering("tirx.erf", target="llvm", f=_elementwise_float32(_erf), level=100)

SPATIAL, REDUCTION = 0, 2  # tirx.IterVar iter_type values


def _inline_all(sch: s_tir.Schedule, root) -> None:
    for block in sch.get_child_blocks(root):
        # An exponential two blocks read (softmax's exp(x - max), by its sum and by its
        # normalisation) is stored once: inlined, each reader recomputes it, and an exp costs
        # more than the store and the load (softmax on 2048 rows of 128: 117 -> 90 us).
        if len(sch.get_consumers(block)) > 1 and "T.exp(" in sch.get(block).script():
            continue
        try:
            sch.compute_inline(block)
        except ScheduleError:  # a reduction or an output: stays
            pass
    for block in reversed(sch.get_child_blocks(root)):
        try:
            sch.reverse_compute_inline(block)
        except ScheduleError:
            pass


def _uses(expr, var) -> bool:
    return any(used.same_as(var) for used in tirx.analysis.undefined_vars(expr))


def _along_rows(block: tirx.Stmt, spatial_var, reduction_var) -> bool:
    """Whether ``block`` reads contiguously (last index) along its reduction axis, and what
    it reads along that axis never contiguously along its innermost spatial one: a softmax's
    or a norm's row sums, unlike a matrix product, whose other operand is contiguous along
    the spatial axis."""
    along = [[r.min for r in read.region] for read in block.reads
             if any(_uses(r.min, reduction_var) for r in read.region)]
    return (any(_uses(index[-1], reduction_var) for index in along)
            and not any(_uses(index[-1], spatial_var) for index in along))


def _parallel(sch: s_tir.Schedule, loops: list, block) -> None:
    """The loops fused into one, run in parallel when it has more than one iteration and the
    block's loop nest, ``loops`` and those inside them, has SERIAL_WORK iterations or more."""
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    work = math.prod(int(sch.get(loop).extent) for loop in sch.get_loops(block))
    if int(sch.get(fused).extent) > 1 and work >= SERIAL_WORK:
        sch.parallel(fused)


def _schedule_rows(sch: s_tir.Schedule, block, spatial: list, reduction) -> None:
    """A row reduction: VECTOR partial results per row, lane l over the row's elements l,
    l + VECTOR, ... (rfactor), the lanes a vector over contiguous elements; then each row's
    VECTOR partial results combined."""
    _, lanes = sch.split(reduction, [None, VECTOR])
    partial = sch.rfactor(lanes, factor_axis=len(spatial))  # lanes last: contiguous
    _parallel(sch, sch.get_loops(partial)[:len(spatial)], partial)
    _, outer, lanes = sch.get_loops(partial)
    sch.decompose_reduction(partial, outer)
    sch.unroll(lanes)  # LLVM vectorises the unrolled lanes (vectorize refuses a reduction)
    _parallel(sch, sch.get_loops(block)[:len(spatial)], block)


def _schedule_block(sch: s_tir.Schedule, block) -> str:
    """Schedule one block; returns what it was: spatial, reduction, rows (a row reduction),
    scalar or skipped."""
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    # The rule reads loop i as block axis i: true of legalized kernels, whose loops are the
    # spatial axes then the reduction axes.
    if len(loops) != len(kinds) or kinds != sorted(kinds) or set(kinds) - {SPATIAL, REDUCTION}:
        return "skipped"
    if any(int(sch.get(loop).extent) == 0 for loop in loops):  # an empty tensor: nothing
        return "skipped"  # to run, and fusing its loops divides by their extent
    spatial = [loop for loop, kind in zip(loops, kinds) if kind == SPATIAL]
    reduction = [loop for loop, kind in zip(loops, kinds) if kind == REDUCTION]
    extents = [int(sch.get(loop).extent) for loop in spatial]
    wide = [i for i, extent in enumerate(extents) if extent > 1]
    if not wide:
        return "scalar"
    last = wide[-1]
    axes = sch.get(block).iter_vars
    row = int(sch.get(reduction[0]).extent) if len(reduction) == 1 else 0
    if (row > VECTOR and row % VECTOR == 0
            and _along_rows(sch.get(block), axes[last].var, axes[-1].var)):
        _schedule_rows(sch, block, spatial, reduction[0])
        return "rows"
    before, inner, after = spatial[:last], spatial[last], spatial[last + 1:]
    if extents[last] > VECTOR:
        split_outer, inner = sch.split(inner, [None, VECTOR])
        before = before + [split_outer]
    outer = before + after
    sch.reorder(*outer, *reduction, inner)
    if outer:
        _parallel(sch, outer, block)
    if reduction:
        sch.decompose_reduction(block, reduction[0])
    try:
        sch.vectorize(inner)
    except ScheduleError:
        sch.unroll(inner)
    return "reduction" if reduction else "spatial"


def schedule_cpu_kernels(mod: tvm.IRModule) -> Counter:
    """Schedule, in place, every unscheduled PrimFunc of a legalized ``mod``; returns how many
    kernels each outcome had (spatial, reduction, scalar, skipped)."""
    taken = Counter()
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs and func.attrs.get(
                "tirx.is_scheduled"):
            continue
        sch = s_tir.Schedule(func)
        if LOSS_KERNEL in func.attrs:  # a kernel of ours, with its own schedule
            schedule_softmax_nll_loss(sch, VECTOR)
            mod[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
            taken["loss"] += 1
            continue
        try:
            root = sch.get_sblock("root")
        except ScheduleError:  # hand-written TIR with no root block (e.g. take_backward)
            taken["skipped"] += 1
            continue
        _inline_all(sch, root)
        # Inlined reshapes leave indices such as (i // 128 * 128 + i % 128) % 512 that hide a
        # contiguous access from vectorize and LLVM; simplified with the loops' bounds, that
        # index is i again (llama_tiny's SwiGLU kernel: 115 us a call, simplified 85). The
        # simplified function shares what did not change with ``func``, which a schedule of it
        # then changed in place: a copy.
        simplified = s_tir.transform.StmtSimplify()(sch.mod)["main"]
        sch = s_tir.Schedule(tvm.ir.load_json(tvm.ir.save_json(simplified)))
        root = sch.get_sblock("root")
        for block in sch.get_child_blocks(root):
            try:
                taken[_schedule_block(sch, block)] += 1
            except ScheduleError:  # the steps taken before it still hold: each is exact
                taken["skipped"] += 1
        mod[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return taken


def with_cpu_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[tvm.IRModule,
                                                                              Counter]:
    """For an llvm target, a copy of ``mod`` with its kernels scheduled, and how many each
    outcome had; for other targets ``mod`` itself (GPU kernels: pipelines/backend/gpu.py)."""
    if target.kind.name != "llvm":
        return mod, Counter()
    scheduled = mod.clone()
    return scheduled, schedule_cpu_kernels(scheduled)


def tunable_kernels(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The kernels a CPU build schedules: unscheduled PrimFuncs with a root block (the
    hand-written ones without, e.g. take_backward, keep TVM's code), by name."""
    kernels = {}
    for gvar, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):
        if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get(
                "tirx.is_scheduled")):
            continue
        try:
            s_tir.Schedule(func).get_sblock("root")
        except ScheduleError:
            continue
        kernels[gvar.name_hint] = func
    return kernels


def _anchor_schedule(func: tirx.PrimFunc, target, anchored) -> s_tir.Schedule | None:
    """``func`` scheduled by the trace of a record of its anchor block (``anchored``:
    databases.by_anchor_block), its other blocks inlined or parallelised by TVM's
    ``schedule_using_anchor_trace``; None where there is no such record or it does not apply
    (a kernel with more outputs than the traced one's)."""
    record = best_record([anchored], func)
    if record is None:
        return None
    sch = s_tir.Schedule(workload(func))
    try:
        schedule_using_anchor_trace(sch, record.trace, target)
    except tvm.error.InternalError:
        return None
    return sch


def apply_database(mod: tvm.IRModule, target, database) -> tuple[tvm.IRModule, Counter]:
    """A copy of ``mod`` whose kernels with a record in ``database`` carry their tuned schedule,
    or where there is none, the schedule of a record of their anchor block (a tuned convolution
    for the same convolution with another epilogue); marked scheduled, so the default schedules
    leave them. And how many kernels went each way (tuned, anchor)."""
    out, taken, anchored = mod.clone(), Counter(), None
    for name, func in tunable_kernels(mod).items():
        schedule, way = database.query_schedule(workload(func), target=target,
                                                workload_name="main"), "tuned"
        if schedule is None:
            anchored = by_anchor_block([database]) if anchored is None else anchored
            schedule, way = _anchor_schedule(func, target, anchored), "anchor"
        if schedule is None:
            continue
        scheduled = schedule.mod["main"].without_attr("global_symbol")  # the kernel's own name:
        if func.attrs and "global_symbol" in func.attrs:
            scheduled = scheduled.with_attr("global_symbol", func.attrs["global_symbol"])
        out[out.get_global_var(name)] = scheduled.with_attr("tirx.is_scheduled", True)
        taken[way] += 1
    return out, taken


def schedule_cpu(mod: tvm.IRModule, target, database=None) -> tuple[tvm.IRModule, Counter]:
    """``mod`` as a CPU build schedules it: kernels with a record in ``database`` take their
    tuned schedule (or their anchor block's: apply_database), the rest the default one; with
    how many kernels each way went."""
    tuned = Counter()
    if database is not None and target.kind.name == "llvm":
        mod, tuned = apply_database(mod, target, database)
    mod, taken = with_cpu_schedules(mod, target)
    return mod, taken + tuned

