"""torch.export program -> Relax IRModule whose ``main`` is a pure function of its state.

TVM 0.27's exported-program importer bakes batch-norm running statistics in as constants and
drops their updates (it even returns zeros for the new running variance). A training step must
carry them, so this translator keeps every buffer as a function input and returns its new value:

    main(x, *parameters, *buffers) -> (logits, *new_buffers)

It also records which PyTorch module each Relax binding came from, so later stages can name
the layer behind an operator (e.g. one with no gradient rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from pipelines.ir import dtype_of, shape_of, tensor_type


@dataclass
class _BufferState:
    """Buffers met while translating, in graph order: (input var, new-value var)."""

    updates: list[tuple[relax.Var, relax.Var]] = field(default_factory=list)


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


def _batch_norm_training(state: _BufferState):
    """Converter for aten._native_batch_norm_legit_functional (batch norm in training mode)."""

    def convert(node, importer) -> relax.Var:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        gamma, beta = importer.env[node.args[1]], importer.env[node.args[2]]
        mean_node, var_node = node.args[3], node.args[4]
        momentum, eps = float(node.args[6]), float(node.args[7])
        sinfo = tensor_type([shape_of(x)[1]], dtype_of(x))
        # Fresh vars: the importer would bind these buffers to constants afterwards.
        running_mean = relax.Var(mean_node.name, sinfo)
        running_var = relax.Var(var_node.name, sinfo)
        out, new_mean, new_var = training_batch_norm(bb, x, gamma, beta, running_mean,
                                                     running_var, momentum, eps)
        state.updates += [(running_mean, new_mean), (running_var, new_var)]
        # The aten op returns (out, save_mean, save_rstd, new_mean, new_var); the forward graph
        # reads only out and the new statistics, so slots 1-2 repeat those instead of emitting
        # statistics nothing uses.
        return bb.emit(relax.Tuple([out, new_mean, new_var, new_mean, new_var]))

    return convert


def _module_of(node) -> str:
    """The innermost PyTorch module an FX node ran in, as "path (Type)"."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<model>"
    path, kind = list(stack.values())[-1]
    return f"{path or '<model>'} ({str(kind).rsplit('.', 1)[-1]})"


def _recording(convert, produced: dict, takes_importer: bool):
    """Wrap a converter so the Relax var it returns is tagged with the node's module."""

    def wrapped(node, importer):
        value = convert(node, importer) if takes_importer else convert(node)
        if isinstance(value, relax.Var):
            produced[value] = _module_of(node)
        return value

    return wrapped


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


def translate(program: torch.export.ExportedProgram) -> tuple[relax.Function, dict, dict]:
    """Translate; return ``main``, the name table {relax name: (kind, torch name)} and the
    origin table {binding name: PyTorch module}."""
    state, produced = _BufferState(), {}
    # Core ATen ops, as TVM's from_exported_program does (adaptive pooling becomes a mean).
    program = program.run_decompositions()
    importer = ExportedProgramImporter()
    converters = {name: _recording(fn, produced, takes_importer=False)
                  for name, fn in importer.convert_map.items()}
    converters["_native_batch_norm_legit_functional.default"] = _recording(
        _batch_norm_training(state), produced, takes_importer=True)
    mod = importer.from_exported_program(program, keep_params_as_input=True,
                                         unwrap_unit_return_tuple=True,
                                         no_bind_return_tuple=False,
                                         custom_convert_map=converters)
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
    func = with_buffers(main, state.updates)
    return func, names, origins_of(func, produced)


def with_buffers(main: relax.Function, updates: list[tuple[relax.Var, relax.Var]]):
    """``main(x, *params) -> logits`` rebuilt as ``main(x, *params, *buffers) -> (logits,
    *new_buffers)``. Weights travel in a separate parameters file, so the "params" attribute
    (weights inlined in IR) is dropped."""
    body = main.body
    outputs = relax.Tuple([body.body] + [new for _, new in updates])
    new_body = relax.BlockBuilder().normalize(relax.SeqExpr(body.blocks, outputs))
    func = relax.Function(list(main.params) + [var for var, _ in updates], new_body)
    return func.with_attr("global_symbol", "main").with_attr("num_input", 1)
