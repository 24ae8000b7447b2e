"""GPU targets (CUDA, OpenCL): every kernel needs a thread binding before it compiles.

TVM's default GPU pipeline schedules each fused kernel with the first dlight rule that claims
it, but a rule can claim a kernel it then fails on (on the training step, the Reduction rule
asserts on some fused backward reductions). Here the rules are tried in the same order and a
rule that fails is skipped, down to Fallback, which binds any kernel. The rest is TVM's own
pipeline for the target.
"""
from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl

from pipelines.backend.checked_once import drop_param_checks
from pipelines.kernels.softmax_nll_gpu import is_softmax_nll_loss, softmax_nll_loss_gpu
from pipelines.kernels.take_backward_gpu import is_take_backward, take_backward_gpu

GPU_KINDS = {"cuda", "opencl"}
CAPTURED = "cuda_graph_capture"  # RewriteCUDAGraph's name for a region it lifts
RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"
LIBRARY_PREFIX = "pockengine_"  # the shims' functions (backend/blas.py: LIBRARIES)


# Kernels written for the GPU, each where no rule schedules it well: take_backward is a
# sequential loop no rule binds; Fallback would run the fused loss on one thread.
WRITTEN_FOR_GPU = ((is_take_backward, take_backward_gpu),
                   (is_softmax_nll_loss, softmax_nll_loss_gpu))


def _rules():
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def _scheduled(func: tirx.PrimFunc) -> bool:
    """A kernel TVM's dispatch wrote with its threads bound already (the scan behind cumsum)."""
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


def schedule_kernels(mod: tvm.IRModule, target: tvm.target.Target) -> Counter:
    """Schedule every PrimFunc of ``mod`` in place; returns how many each rule took."""
    taken = Counter()
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or _scheduled(func):
            continue
        written = next((kernel for is_it, kernel in WRITTEN_FOR_GPU if is_it(func)), None)
        if written is not None:
            mod[gvar] = written(func)
            taken[written.__name__] += 1
            continue
        for rule in _rules():
            try:
                space = rule.apply(func, target, False)
            except Exception:  # noqa: BLE001 - a rule that misjudged this kernel: next rule
                continue
            if space is None:
                continue
            schedule = space[0] if isinstance(space, list) else space
            mod[gvar] = schedule.mod["main"].with_attr("tirx.is_scheduled", True)
            taken[type(rule).__name__] += 1
            break
        else:
            raise RuntimeError(f"no GPU schedule rule binds kernel {gvar.name_hint}")
    return taken


@tvm.transform.module_pass(opt_level=0, name="GraphCallsReturnAnObject")
def graph_calls_return(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """A captured region whose kernels only write state in place returns nothing, and the VM
    (TVM 0.27) then writes the region's return into the void register of the call that ran
    it, failing its register check on the GPU. Each such call is declared to return an object
    (the region's empty tuple), so the VM gives it a register."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and CAPTURED not in gvar.name_hint:
            mod[gvar] = _returning_graph_calls(func)
    return mod


def _returning_graph_calls(func: relax.Function) -> relax.Function:
    blocks = []
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            call = binding.value
            if (isinstance(binding, relax.VarBinding) and isinstance(call, relax.Call)
                    and call.args and isinstance(call.args[0], relax.ExternFunc)
                    and call.args[0].global_symbol == RUN_OR_CAPTURE
                    and isinstance(call.ty, relax.TupleType) and not call.ty.fields):
                call = relax.Call(call.op, call.args, call.attrs, [relax.ObjectType()])
                binding = relax.VarBinding(relax.Var(binding.var.name, relax.ObjectType()),
                                           call)
            bindings.append(binding)
        blocks.append(relax.BindingBlock(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def kernel_launches(mod: tvm.IRModule) -> Counter:
    """Kernel calls of the built step (a library's product, backend/blas.py, counts as one):
    ``launched`` one by one from ``train_step``, and ``in_cuda_graphs`` inside the regions
    RewriteCUDAGraph lifted (``cuda_graphs`` of them, each replayed as one launch)."""
    kernels = {g for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}

    def is_kernel(value) -> bool:
        op = getattr(value, "op", None)
        return isinstance(value, relax.Call) and (op in kernels or (
            isinstance(op, relax.ExternFunc) and op.global_symbol.startswith(LIBRARY_PREFIX)))

    counts = Counter()
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        captured = CAPTURED in gvar.name_hint
        counts["cuda_graphs"] += captured
        for block in func.body.blocks:
            calls = sum(is_kernel(b.value) for b in block.bindings)
            counts["in_cuda_graphs" if captured else "launched"] += calls
    return counts


def gpu_pipeline(target: tvm.target.Target, taken: Counter, launches: Counter):
    """TVM's pipeline for ``target`` with the kernels scheduled by ``schedule_kernels``; what
    each rule took goes into ``taken``, the step's ``kernel_launches`` into ``launches``."""
    from tvm.relax.backend.cuda import pipeline as cuda

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            mod = tvm.transform.Sequential(
                cuda.library_dispatch_passes(target)
                + [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                   relax.transform.FoldConstant(), relax.transform.FuseOps(),
                   relax.transform.FuseTIR()])(mod)
            taken.update(schedule_kernels(mod, target))
            # RewriteCUDAGraph only acts on CUDA targets; the rest is target-neutral.
            # An in-place update leaves ``new = old`` behind; TVM's CUDA-graph rewrite lifts
            # such a binding into a graph without returning it: the aliases go first.
            finalize = cuda.finalize_passes(target)
            at = [p.info.name for p in finalize].index("RewriteCUDAGraph") + 1
            mod = tvm.transform.Sequential(cuda.dataflow_lower_passes(target)
                                           + [relax.transform.CanonicalizeBindings()]
                                           + finalize[:at] + [graph_calls_return]
                                           + finalize[at:] + [drop_param_checks])(mod)
        launches.update(kernel_launches(mod))
        return mod

    return _pipeline
