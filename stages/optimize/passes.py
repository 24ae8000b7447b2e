"""Target-independent optimizations of the training step, and its static memory plan."""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from pipelines.ir import nbytes
from stages.optimize.gemm import isolate_gemms
from stages.optimize.loss import fuse_losses
from stages.optimize.recompute import recompute
from stages.optimize.schedule import liveness, reorder_updates

# Operator fusion works on legalized TIR: elementwise and broadcast work (the SGD update, batch
# norm arithmetic, ReLU6 masks) folds into the kernel that produces its input.
FUSION = [
    relax.transform.CanonicalizeBindings(),
    relax.transform.LegalizeOps(),
    relax.transform.AnnotateTIROpPattern(),
    relax.transform.FoldConstant(),
    relax.transform.FuseOps(),
    relax.transform.FuseTIR(),
    relax.transform.DeadCodeElimination(["train_step"]),
]


@relax.expr_functor.mutator
class _PlainPowers(relax.PyExprMutator):
    """x ** 2 and x ** 1 as x * x and x. RMS norm squares its input, and its gradient is
    2 * x ** 1 by the power rule; as kernels these are powf calls per element, whose exponent
    (a constant the fusion passes in as a buffer) LLVM cannot see: 1.75 ms of the llama_tiny
    transformer_paper step's 50 ms went to its four RMS norm gradients."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.power" or not isinstance(
                call.args[1], tvm.ir.expr.Constant) or call.args[1].value.numpy().ndim:
            return call
        base, exponent = call.args[0], float(call.args[1].value.numpy())
        if exponent == 1.0 and tvm_ffi.structural_equal(base.ty, call.ty):
            return base
        if exponent == 2.0:
            return relax.op.multiply(base, base)
        return call


def plain_powers(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its constant exponents folded and the plain ones rewritten (_PlainPowers)."""
    mod = relax.transform.FoldConstant()(mod)  # 2 - 1 in the gradient: the constant 1
    mutator = _PlainPowers(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


# The build's own first steps up to static memory planning, to read the plan without building.
PLAN = [
    relax.transform.RewriteDataflowReshape(),
    relax.transform.ToNonDataflow(),
    relax.transform.RemovePurityChecking(),
    relax.transform.CallTIRRewrite(),
    relax.transform.StaticPlanBlockMemory(),
]


def optimize(step: relax.Function, signature: dict, reorder: bool,
             recomputed: bool = False) -> tvm.IRModule:
    """The pruned step, its updates reordered when ``reorder``, its cheap activations
    recomputed in the backward pass when ``recomputed``, its cross-entropy loss and gradient
    one kernel, fused, as a module."""
    if reorder:
        step = reorder_updates(step, update_outputs(signature))
    if recomputed:
        step, _ = recompute(step, update_outputs(signature))
    mod = tvm.IRModule({"train_step": step.with_attr("global_symbol", "train_step")})
    mod, _ = fuse_losses(mod)
    mod, _ = isolate_gemms(mod)
    return tvm.transform.Sequential(FUSION)(plain_powers(mod))


def update_outputs(signature: dict) -> dict[int, str]:
    """Output index -> parameter, for the outputs that hold a new parameter or optimizer state
    (the optimizer's shared step count belongs to "optimizer")."""
    owner = {p: p for p in signature["trainable"]}
    owner |= {n: info["param"] or "optimizer" for n, info in signature["optimizer_state"].items()}
    return {i: owner[name.removeprefix("new_")] for i, name in enumerate(signature["outputs"])
            if name.removeprefix("new_") in owner}


def memory_plan(mod: tvm.IRModule, signature: dict) -> dict:
    """Bytes the VM holds for one step after static planning: inputs (weights, state, batch),
    planned storage for intermediates (reused across their lifetimes), and outputs; plus what
    is alive at the step's peak, by kind (stages/optimize/schedule.py)."""
    planned = tvm.transform.Sequential(PLAN)(mod)
    func = planned["train_step"]
    storage = outputs = 0

    def visit(expr):
        nonlocal storage, outputs
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.name == "relax.memory.alloc_storage":
                storage += int(expr.args[0].values[0])
            elif expr.op.name == "relax.builtin.alloc_tensor":
                outputs += nbytes(expr.ty)

    relax.analysis.post_order_visit(func.body, visit)
    P = signature["num_params"]
    sizes = dict(zip(signature["inputs"], (nbytes(p) for p in func.params)))
    names = signature["inputs"]
    inputs = {
        "batch": sizes["x"] + sizes["y"],
        "weights": sum(sizes[n] for n in names[2:2 + P]),
        "optimizer_state": sum(sizes[n] for n in signature["optimizer_state"]),
    }
    inputs["buffers"] = sum(sizes.values()) - sum(inputs.values())
    total_inputs = sum(inputs.values())
    return {"planned_peak_bytes": total_inputs + storage + outputs,
            "inputs_bytes": total_inputs, "inputs": inputs,
            "planned_storage_bytes": storage, "outputs_bytes": outputs,
            "liveness": liveness(mod["train_step"], update_outputs(signature))}
