"""A torch.export program -> Relax ``main``, a pure function of its state.

TVM 0.27's exported-program importer bakes batch-norm running statistics in as constants and
drops their updates (it even returns zeros for the new running variance). A training step must
carry them, so this translator keeps every buffer as a function input and returns its new value:

    main(*inputs, *parameters, *buffers) -> (logits, *new_buffers)

It also records which PyTorch module each Relax binding came from, so later stages can name
the layer behind an operator (e.g. one with no gradient rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from pipelines.frontends.export_rewrites import (module_of, no_grad_as_detach,
                                                refuse_data_dependent_shapes,
                                                refuse_randomness)
from pipelines.frontends.graph import origins_of, training_batch_norm, with_buffers
from pipelines.frontends.layers import tied_parameters
from pipelines.frontends.torch_converters import (COMPLEX_AWARE, CONVERTERS, FLOAT_RESULTS,
                                                 complex_or, float_inputs)
from pipelines.ir import FIXED_PARAMETERS, PADDING_ROWS, dtype_of, shape_of, tensor_type


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


def _recording(convert, produced: dict, takes_importer: bool):
    """Wrap a converter so the Relax var it returns is tagged with the node's module."""

    def wrapped(node, importer):
        value = convert(node, importer) if takes_importer else convert(node)
        if isinstance(value, relax.Var):
            produced[value] = module_of(node)
        return value

    return wrapped


def _views_as_reshapes(program: torch.export.ExportedProgram) -> None:
    """Every aten.view in ``program``'s graph as aten.reshape (the same values wherever the view
    was valid). Re-tracing for the decompositions can give a tensor other strides than the
    export saw, and a view of it then fails (GPT-2's Conv1D: "Cannot view a tensor with shape
    [4, 16, 32] and strides (32, 128, 1)"); Relax has no strides, so both become reshape."""
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    program.graph_module.recompile()


def _padding_rows(program: torch.export.ExportedProgram, parameters: set) -> dict[str, int]:
    """{input name: row}: embeddings whose ``padding_idx`` row PyTorch never updates (the
    lookup passes it no gradient; transformers sets it to the pad token). TVM's converter
    reads the embedding as a plain take, whose gradient would reach that row. Only a weight
    the lookup alone reads: where it is also read elsewhere (tied to an LM head), the other
    use's gradient does reach that row, and masking the row would drop it."""
    rows = {}
    for node in program.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.aten.embedding.default
                and len(node.args) > 2 and int(node.args[2]) >= 0
                and getattr(node.args[0], "name", None) in parameters
                and len(node.args[0].users) == 1):
            rows[node.args[0].name] = int(node.args[2])
    return rows


def translate(program: torch.export.ExportedProgram) -> tuple[relax.Function, dict, dict]:
    """Translate; return ``main``, the name table {relax name: (kind, torch name)} and the
    origin table {binding name: PyTorch module}. ``main``'s attribute ``num_input`` counts the
    model's inputs."""
    state, produced = _BufferState(), {}
    tied = tied_parameters(program)
    refuse_randomness(program)  # a saved program (.pt2) is checked here
    refuse_data_dependent_shapes(program)
    _views_as_reshapes(program)
    no_grad_as_detach(program)
    # Core ATen ops, as TVM's from_exported_program does (adaptive pooling becomes a mean),
    # but detach kept: it would become an alias, which TVM converts as the value itself
    decompositions = torch.export.default_decompositions()
    decompositions.pop(torch.ops.aten.detach.default)
    program = program.run_decompositions(decompositions)
    importer = ExportedProgramImporter()
    converters = {name: _recording(fn, produced, takes_importer=False)
                  for name, fn in importer.convert_map.items()}
    converters.update({name: _recording(float_inputs(importer.convert_map[name]), produced,
                                        takes_importer=True) for name in FLOAT_RESULTS})
    converters.update({name: _recording(fn, produced, takes_importer=True)
                       for name, fn in CONVERTERS.items()})
    converters.update({name: _recording(complex_or(importer.convert_map[name], fn), produced,
                                        takes_importer=True)
                       for name, fn in COMPLEX_AWARE.items()})
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
    parameters = {k for k, (kind, _) in names.items() if kind == "parameter"}
    padding = _padding_rows(program, parameters - set(tied) - set(tied.values()))
    if padding:
        func = func.with_attr(PADDING_ROWS, padding)
    fixed = [name for name in sorted(parameters - set(tied))
             if not program.state_dict[names[name][1]].requires_grad]
    if fixed:
        func = func.with_attr(FIXED_PARAMETERS, fixed)
    if tied:  # each tied name reads the first one's input, which it no longer has
        inputs = {p.name: p for p in func.params}
        func = func.bind_params({inputs[name]: inputs[first] for name, first in tied.items()})
        names = {k: v for k, v in names.items() if k not in tied}
    return func, names, origins_of(func, produced)


def lower_program(path) -> tuple[relax.Function, dict, dict, dict]:
    """A saved torch.export program (.pt2): ``main``, the name and origin tables and the initial
    value of every parameter and buffer, by Relax name."""
    program = torch.export.load(path)
    func, names, origins = translate(program)
    state = program.state_dict | dict(program.named_buffers())
    values = {name: state[source].detach().numpy() for name, (_, source) in names.items()
              if name in {v.name for v in func.params}}
    return func, names, origins, values
