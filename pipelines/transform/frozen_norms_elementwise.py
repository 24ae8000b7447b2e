"""An eval-mode batch norm -> its arithmetic, per channel, which FuseOps folds into the kernel of
the convolution that produces its input.

Legalized whole, a batch norm is a kernel of its own with three outputs, which FuseOps cannot put
in a convolution's epilogue: every frozen layer of MobileNetV2 wrote its convolution's output to
memory and read it back to normalise it (52 kernels of mbv2_paper's step). As elementwise and
broadcast operators it fuses, so a convolution, its batch norm and its ReLU6 become one kernel,
the paper's "fold the batch norm into the convolution" for layers whose weights may still train
(their weights are state, not constants, so they cannot be folded ahead of time). The formula is
the one TOPI's batch norm computes. Run after autodiff (the gradient rules see the batch norm)
and before LegalizeOps; a training-mode batch norm (it computes and returns the batch's
statistics) stays as it is.

Before::

    lv = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, epsilon=1e-05, training=False)

After::

    m = R.expand_dims(mean, axis=[0, 2, 3])
    v = R.expand_dims(var, axis=[0, 2, 3])
    g = R.expand_dims(gamma, axis=[0, 2, 3])
    b = R.expand_dims(beta, axis=[0, 2, 3])
    lv = (R.add(R.multiply(R.divide(R.subtract(x, m), R.sqrt(R.add(v, 1e-05))), g), b),
          mean, var)
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.ir import with_attrs_of


@relax.expr_functor.mutator
class _FrozenNormsElementwise(relax.PyExprMutator):
    """Rewrites one call at a time (the module docstring says why)."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.nn.batch_norm" or bool(call.attrs.training):
            return call
        x, gamma, beta, mean, var = call.args
        axis = int(call.attrs.axis) % x.ty.ndim
        others = [i for i in range(x.ty.ndim) if i != axis]

        def per_channel(vector):
            return self.builder_.emit(relax.op.expand_dims(vector, others))

        epsilon = relax.const(float(call.attrs.epsilon), x.ty.dtype)
        y = relax.op.divide(relax.op.subtract(x, per_channel(mean)),
                            relax.op.sqrt(relax.op.add(per_channel(var), epsilon)))
        if call.attrs.scale:
            y = relax.op.multiply(y, per_channel(gamma))
        if call.attrs.center:
            y = relax.op.add(y, per_channel(beta))
        return relax.Tuple([y, mean, var])


@tvm.transform.module_pass(opt_level=0, name="FrozenNormsElementwise")
class FrozenNormsElementwise:
    """Every Relax function's eval-mode batch norms as their arithmetic (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mutator = _FrozenNormsElementwise(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gvar, mutator.visit_expr(func))
        return with_attrs_of(mod, mutator.builder_.get())
