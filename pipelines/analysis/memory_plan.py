"""The training step's static memory plan: the bytes the VM holds for one step after TVM's static
planning (inputs, planned intermediates, outputs), and what is alive at the liveness peak."""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import liveness, update_owners
from pipelines.ir import nbytes
from pipelines.stored_weights import SCALES


def memory_plan(mod: tvm.IRModule, planned: tvm.IRModule, signature: dict) -> dict:
    """Bytes the VM holds for one step after static planning (``planned``: ``mod`` through the
    CPU build's planning passes, pipelines/compile.py's PLAN): inputs (weights,
    state, batch), planned storage for intermediates (reused across their lifetimes), and
    outputs; plus what is alive at the step's peak, by kind (analysis/liveness.py)."""
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
    data, count = signature["data"], signature["num_params"]
    sizes = dict(zip(signature["inputs"], (nbytes(p) for p in func.params)))
    params = signature["inputs"][len(data):len(data) + count]
    params += list(signature.get(SCALES, {}).values())  # an int8 weight's scales are part of it
    inputs = {
        "batch": sum(sizes[n] for n in data),
        "weights": sum(sizes[n] for n in params),
        "optimizer_state": sum(sizes[n] for n in signature["optimizer_state"]),
    }
    inputs["buffers"] = sum(sizes.values()) - sum(inputs.values())
    total_inputs = sum(inputs.values())
    return {"planned_peak_bytes": total_inputs + storage + outputs,
            "inputs_bytes": total_inputs, "inputs": inputs,
            "planned_storage_bytes": storage, "outputs_bytes": outputs,
            "liveness": liveness(mod["train_step"], update_owners(signature))}
