"""Gradient rules for elementwise ops TVM 0.27 gives no rule: the inverse and hyperbolic
trigonometric functions (acos: the angle between unit vectors), tan and square, the
activations softplus, leaky ReLU and SELU, and the rounding ops, whose gradient PyTorch
defines as 0 (a rounded value read straight through is ``x + (round(x) - x).detach()``).

Each is y = f(x), dx = f'(x) * dy, with f' from x (and y, where that is shorter); each is
checked numerically against PyTorch autograd in tests/test_gradient_rules.py.
"""
from __future__ import annotations

from tvm import relax
from tvm.relax.op import (add, cosh, divide, exp, greater, multiply, sigmoid, sinh, sqrt,
                          subtract, where, zeros_like)

from pipelines.ir import dtype_of


def _unary(derivative):
    """The rule of y = f(x) given f' as ``derivative(x, y, attrs, constant)``."""

    def rule(orig_var, orig_call, output_grad, ctx):
        x = orig_call.args[0]
        dtype = dtype_of(x)

        def c(value):
            return relax.const(value, dtype)

        return [multiply(output_grad, derivative(x, orig_var, orig_call.attrs, c))]

    return rule


def _one_minus_square(x, c):
    return subtract(c(1.0), multiply(x, x))


# SELU's constants, as torch.nn.SELU and TVM's selu use them
SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946

DERIVATIVES = {
    "relax.acos": lambda x, y, a, c: divide(c(-1.0), sqrt(_one_minus_square(x, c))),
    "relax.asin": lambda x, y, a, c: divide(c(1.0), sqrt(_one_minus_square(x, c))),
    "relax.atan": lambda x, y, a, c: divide(c(1.0), add(c(1.0), multiply(x, x))),
    "relax.acosh": lambda x, y, a, c: divide(c(1.0), sqrt(subtract(multiply(x, x), c(1.0)))),
    "relax.asinh": lambda x, y, a, c: divide(c(1.0), sqrt(add(multiply(x, x), c(1.0)))),
    "relax.atanh": lambda x, y, a, c: divide(c(1.0), _one_minus_square(x, c)),
    "relax.sinh": lambda x, y, a, c: cosh(x),
    "relax.cosh": lambda x, y, a, c: sinh(x),
    "relax.tan": lambda x, y, a, c: add(c(1.0), multiply(y, y)),
    "relax.square": lambda x, y, a, c: multiply(c(2.0), x),
    # softplus(x) = log(1 + exp(beta x)) / beta, linear above beta x > threshold (PyTorch's)
    "relax.nn.softplus": lambda x, y, a, c: where(
        greater(multiply(x, c(float(a.beta))), c(float(a.threshold))), c(1.0),
        sigmoid(multiply(x, c(float(a.beta))))),
    # PyTorch's leaky ReLU and SELU take the negative side's slope at exactly 0
    "relax.nn.leakyrelu": lambda x, y, a, c: where(greater(x, c(0.0)), c(1.0),
                                                   c(float(a.alpha))),
    "relax.nn.selu": lambda x, y, a, c: where(greater(x, c(0.0)), c(SELU_SCALE),
                                              multiply(c(SELU_SCALE * SELU_ALPHA), exp(x))),
}


def _zero_grad(orig_var, orig_call, output_grad, ctx):
    """A rounding op: piecewise constant, its gradient 0 where it has one (as PyTorch)."""
    return [zeros_like(orig_call.args[0])]


UNARY_RULES = {
    **{name: _unary(derivative) for name, derivative in DERIVATIVES.items()},
    **dict.fromkeys(["relax.round", "relax.floor", "relax.ceil", "relax.trunc", "relax.sign"],
                    _zero_grad),
}
