"""R.grad.max_pool2d_backward -> a call of kernels/max_pool_grad.py's kernel.

TVM's legalization of max pooling's gradient reads past its argmax buffer (the kernel's
docstring says where); this pass gives the call a kernel that does not, before LegalizeOps.
A call the kernel does not take (dilation, another layout, a symbolic shape) stays as it was.

Before::

    dx = R.grad.max_pool2d_backward(dy, x, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])

After::

    dx = R.call_tir(max_pool2d_grad, (dy, x), out_sinfo=R.Tensor(x.shape, "float32"))
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.ir import op_name, static_float32_shape, with_attrs_of
from pipelines.kernels.max_pool_grad import LAYOUTS, max_pool2d_grad


def _takes(call) -> bool:
    attrs = call.attrs
    return (all(int(d) == 1 for d in attrs.dilation) and str(attrs.layout) in LAYOUTS
            and str(attrs.out_layout) == str(attrs.layout)
            and all(static_float32_shape(a) is not None for a in call.args))


@relax.expr_functor.mutator
class _InBounds(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != "relax.grad.max_pool2d_backward" or not _takes(call):
            return call
        attrs = call.attrs
        return self.builder_.call_te(
            max_pool2d_grad, call.args[0], call.args[1], list(attrs.pool_size),
            list(attrs.strides), list(attrs.padding), str(attrs.layout),
            primfunc_name_hint="max_pool2d_grad")


@tvm.transform.module_pass(opt_level=0, name="MaxPoolGradInBounds")
class MaxPoolGradInBounds:
    """Every Relax function's max pooling gradients as in-bounds kernels (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _InBounds(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        return with_attrs_of(mod, mutator.builder_.get())
