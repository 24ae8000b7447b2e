"""``train_step`` without its per-call parameter checks: a pass after TVM's VMShapeLower.

VMShapeLower makes a function check every parameter's dtype, rank and shape on every call
(``vm.builtin.check_tensor_info`` and ``vm.builtin.match_shape``): two VM builtin calls per
tensor, about half the calls of a MobileNetV2 step (each weight and optimizer buffer is a
parameter). The step's shapes are static, so its callers check them once instead: the native
runner when it reads the data and the state, CompiledStep when it makes the arguments
(runtime/step.py). Only a function with no symbolic shape (no shape heap to fill) loses them.
"""
from __future__ import annotations

import tvm
from tvm import relax

FUNCTION = "train_step"
CHECKS = ("vm.builtin.check_tensor_info", "vm.builtin.match_shape")


def _extern(binding: relax.Binding) -> str | None:
    value = binding.value
    if isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc):
        return str(value.op.global_symbol)
    return None


@tvm.transform.module_pass(opt_level=0, name="DropParamChecks")
def drop_param_checks(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    if FUNCTION not in [g.name_hint for g in mod.get_global_vars()]:
        return mod
    gvar = mod.get_global_var(FUNCTION)
    func = mod[gvar]
    blocks = func.body.blocks
    bindings = [b for block in blocks for b in block.bindings]
    if any(_extern(b) == "vm.builtin.alloc_shape_heap" for b in bindings):
        return mod  # a symbolic shape: match_shape stores it, and must run
    params = set(func.params)
    kept = [relax.BindingBlock([b for b in block.bindings
                                if not (_extern(b) in CHECKS and b.value.args[0] in params)])
            for block in blocks]
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod[gvar] = relax.Function(func.params, relax.SeqExpr(kept, func.body.body),
                               func.ret_ty, func.is_pure, func.attrs, func.span)
    return mod
