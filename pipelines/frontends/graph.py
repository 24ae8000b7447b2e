"""The function every frontend gives, whatever the source:

    main(*inputs, *parameters, *buffers) -> (logits, *new_buffers)

a pure function of its state: buffers (batch-norm running statistics) are inputs and their new
values outputs. The helpers here build that shape, and record which source layer each Relax
binding came from (so later stages can name it in errors).
"""
from __future__ import annotations

import math

from tvm import relax

from pipelines.ir import dtype_of, shape_of


def training_batch_norm(bb: relax.BlockBuilder, x, gamma, beta, running_mean: relax.Var,
                        running_var: relax.Var, momentum: float, eps: float):
    """Batch norm in training mode, as PyTorch's ``train()`` runs it: (output, new running mean,
    new running variance). ``momentum`` is PyTorch's: new = (1-m)*old + m*batch statistic."""
    dims, dtype = shape_of(x), dtype_of(x)
    bn = bb.emit(relax.op.nn.batch_norm(x, gamma, beta, running_mean, running_var, axis=1,
                                        epsilon=eps, momentum=momentum, training=True))
    out = bb.emit(relax.TupleGetItem(bn, 0))
    new_mean = bb.emit_output(relax.TupleGetItem(bn, 1))
    # Relax updates the running variance with the biased batch variance, PyTorch with the
    # unbiased one: new = (1-m)*rv + m*var*n/(n-1) = relax_new*n/(n-1) - (1-m)*rv/(n-1).
    n = dims[0] * math.prod(dims[2:])
    new_var = bb.emit_output(relax.op.subtract(
        relax.op.multiply(relax.TupleGetItem(bn, 2), relax.const(n / (n - 1), dtype)),
        relax.op.multiply(running_var, relax.const((1 - momentum) / (n - 1), dtype))))
    return out, new_mean, new_var


def origins_of(func: relax.Function, produced: dict) -> dict[str, str]:
    """{binding name: module}, from ``produced`` {var: module} of the vars converters
    returned. A converter may emit several bindings and return only the last;
    the ones before it belong to the same module, since converters emit in graph order."""
    origins, pending = {}, []
    for block in func.body.blocks:
        for binding in block.bindings:
            pending.append(binding.var.name)
            if binding.var in produced:
                origins.update(dict.fromkeys(pending, produced[binding.var]))
                pending = []
    return origins


def with_buffers(main: relax.Function, updates: list[tuple[relax.Var, relax.Var]]):
    """``main(x, *params) -> logits`` rebuilt as ``main(x, *params, *buffers) -> (logits,
    *new_buffers)``. Weights travel in a separate parameters file, so the "params" attribute
    (weights inlined in IR) is dropped."""
    body = main.body
    outputs = relax.Tuple([body.body] + [new for _, new in updates])
    new_body = relax.BlockBuilder().normalize(relax.SeqExpr(body.blocks, outputs))
    func = relax.Function(list(main.params) + [var for var, _ in updates], new_body)
    num_input = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else 1
    return func.with_attr("global_symbol", "main").with_attr("num_input", num_input)
