"""torch.export program -> Relax IRModule whose ``main`` is a pure function of its state.

TVM 0.27's exported-program importer bakes batch-norm running statistics in as constants and
drops their updates (it even returns zeros for the new running variance). A training step must
carry them, so this translator keeps every buffer as a function input and returns its new value:

    main(x, *parameters, *buffers) -> (logits, *new_buffers)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

from pipelines.ir import dtype_of, shape_of, tensor_type


@dataclass
class _BufferState:
    """Buffers met while translating, in graph order: (input var, new-value var)."""

    updates: list[tuple[relax.Var, relax.Var]] = field(default_factory=list)


def _batch_norm_training(state: _BufferState):
    """Converter for aten._native_batch_norm_legit_functional (batch norm in training mode)."""

    def convert(node, importer) -> relax.Var:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        gamma, beta = importer.env[node.args[1]], importer.env[node.args[2]]
        mean_node, var_node = node.args[3], node.args[4]
        momentum, eps = float(node.args[6]), float(node.args[7])
        dims, dtype = shape_of(x), dtype_of(x)
        sinfo = tensor_type([dims[1]], dtype)
        # Fresh vars: the importer would bind these buffers to constants afterwards.
        running_mean = relax.Var(mean_node.name, sinfo)
        running_var = relax.Var(var_node.name, sinfo)
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
        state.updates += [(running_mean, new_mean), (running_var, new_var)]
        # The aten op returns (out, save_mean, save_rstd, new_mean, new_var); the forward graph
        # reads only out and the new statistics, so slots 1-2 repeat those instead of emitting
        # statistics nothing uses.
        return bb.emit(relax.Tuple([out, new_mean, new_var, new_mean, new_var]))

    return convert


def translate(program: torch.export.ExportedProgram) -> tuple[relax.Function, dict]:
    """Translate; return ``main`` and the name table {relax name: (kind, torch name)}."""
    state = _BufferState()
    mod = from_exported_program(
        program, keep_params_as_input=True, unwrap_unit_return_tuple=True,
        custom_convert_map={"_native_batch_norm_legit_functional.default":
                            _batch_norm_training(state)})
    main = mod["main"]
    names: dict[str, tuple[str, str]] = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind is InputKind.PARAMETER:
            names[spec.arg.name] = ("parameter", spec.target)
        elif spec.kind is InputKind.BUFFER:
            names[spec.arg.name] = ("buffer", spec.target)
    buffer_vars = [var for var, _ in state.updates]
    for var in buffer_vars:
        if var.name not in names:
            raise ValueError(f"batch norm statistic {var.name} is not a buffer of the model")
    # Rebuild main: buffers become inputs, their new values extra outputs. Weights travel in a
    # separate parameters file, so the "params" attribute (weights inlined in IR) is dropped.
    body = main.body
    logits = body.body
    outputs = relax.Tuple([logits] + [new for _, new in state.updates])
    new_body = relax.BlockBuilder().normalize(relax.SeqExpr(body.blocks, outputs))
    func = relax.Function(list(main.params) + buffer_vars, new_body)
    func = func.with_attr("global_symbol", "main").with_attr("num_input", 1)
    return func, names
