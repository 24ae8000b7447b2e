"""Target-independent optimizations of the training step, and its static memory plan."""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.ir import nbytes

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

# The build's own first steps up to static memory planning, to read the plan without building.
PLAN = [
    relax.transform.RewriteDataflowReshape(),
    relax.transform.ToNonDataflow(),
    relax.transform.RemovePurityChecking(),
    relax.transform.CallTIRRewrite(),
    relax.transform.StaticPlanBlockMemory(),
]


def optimize(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.transform.Sequential(FUSION)(mod)


def memory_plan(mod: tvm.IRModule) -> dict:
    """Bytes the VM holds for one step after static planning: inputs (weights, state, batch),
    planned storage for intermediates (reused across their lifetimes), and outputs."""
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
    inputs = sum(nbytes(p.ty) for p in func.params)
    return {"inputs_bytes": inputs, "planned_storage_bytes": storage,
            "outputs_bytes": outputs, "planned_peak_bytes": inputs + storage + outputs}
