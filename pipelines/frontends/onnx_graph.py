"""ONNX model -> the same Relax ``main`` the PyTorch path gives, through TVM's ONNX frontend:

    main(x, *parameters, *buffers) -> (logits, *new_buffers)

- Every floating-point initializer is a parameter under its ONNX name (a model exported from
  PyTorch keeps its state-dict names, so one scheme fits both paths); other initializers
  (shapes, indices) stay constants. A dynamo export says which initializers are parameters;
  only those are, under the state-dict names onnx_dynamo.py maps back.
- BatchNormalization runs in training mode, as PyTorch's ``train()`` does: batch statistics,
  and its running mean and variance become buffers the step returns updated. An ONNX file is
  usually exported for inference; fine-tuning it is training.
- An exporter that deduplicated equal initializers (``Identity`` of an initializer, as
  torch.onnx does for fresh batch-norm statistics) gets them back as tensors of their own, so a
  running statistic is never also a trained bias.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, _get_convert_map

from pipelines.schema import ConfigError
from pipelines.ir import identifier
from pipelines.frontends.graph import origins_of, training_batch_norm, with_buffers
from pipelines.frontends.onnx_dynamo import (fold_constants, is_dynamo_export, parameters,
                                             restore_parameters)

# Ops the importer handles without a converter class.
BUILT_IN = {"Constant", "If"}
FROZEN_BY_EXPORT = "pock.frozen_by_export"


def load_onnx(path: Path) -> onnx.ModelProto:
    """The model in ``path``, checked: a clear error for a missing or invalid file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such ONNX file (model.source)")
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except (DecodeError, onnx.checker.ValidationError, ValueError) as err:
        raise ConfigError(f"{path}: not a valid ONNX model ({str(err).strip()[:300]})") from err
    return model


def undo_shared_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where each ``Identity`` of an initializer is an initializer of its
    own, under the Identity's output name."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    kept = []
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in inits:
            copy = onnx.TensorProto.FromString(inits[node.input[0]].SerializeToString())
            copy.name = node.output[0]
            graph.initializer.append(copy)
            inits[copy.name] = copy
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return model


def statistics(graph: onnx.GraphProto) -> list[str]:
    """Initializers that are batch-norm running statistics (inputs 3 and 4), in graph order."""
    return [name for node in graph.node if node.op_type == "BatchNormalization"
            for name in node.input[3:5]]


def is_float(tensor: onnx.TensorProto) -> bool:
    return tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def graph_inputs(model: onnx.ModelProto, source="model") -> list:
    """The model's data inputs (initializers aside), in order; an error unless it gives one
    output (the logits)."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    if not inputs or len(graph.output) != 1:
        raise ConfigError(f"{source}: a model to fine-tune takes inputs and gives one output "
                          f"(logits); this one takes {[i.name for i in inputs]} and gives "
                          f"{[o.name for o in graph.output]}")
    return inputs


def prepare(model: onnx.ModelProto, batch_size: int, source="model",
            dims: dict | None = None) -> onnx.ModelProto:
    """``model`` as the import stage saves it, with static shapes (a compiled step has them):
    each input's symbolic first dimension set to ``batch_size``, any other symbolic dimension
    to its value in ``dims`` (by the name the export gave it, e.g. ``sequence``); and shared
    initializers undone; a dynamo export's parameters back under their state-dict names
    (onnx_dynamo.py; those it folded into constants are listed in the model's metadata,
    ``FROZEN_BY_EXPORT``). A symbolic dimension ``dims`` does not bind is an error naming it."""
    lost = []
    if is_dynamo_export(model):
        model, lost = restore_parameters(model, source)
    model = undo_shared_initializers(model)
    dims = dims or {}
    for data in graph_inputs(model, source):
        for axis, dim in enumerate(data.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                continue
            if axis == 0:
                dim.dim_value = batch_size
            elif dim.dim_param in dims:
                dim.dim_value = dims[dim.dim_param]
            else:
                raise ConfigError(
                    f"{source}: input {data.name!r} has a dynamic dimension "
                    f"{dim.dim_param or '(unnamed)'!r} at axis {axis}; bind it in the model's "
                    f"config: dims: {{{dim.dim_param or '<name>'}: <size>}} (e.g. "
                    f"models.<model>.dims.{dim.dim_param or 'sequence'}=128); axis 0 takes "
                    "batch_size")
    if is_dynamo_export(model):  # shapes are static now: fold what they computed
        model = fold_constants(model)
    if lost:
        model.metadata_props.add(key=FROZEN_BY_EXPORT, value=repr(lost))
    return model


def frozen_by_export(model: onnx.ModelProto) -> list[str]:
    """The parameters (and buffers) a dynamo export folded into constants with other values
    (``prepare`` lists them)."""
    props = {p.key: p.value for p in model.metadata_props}
    return ast.literal_eval(props.get(FROZEN_BY_EXPORT, "[]"))


def trainable(model: onnx.ModelProto) -> list[str]:
    """The initializers a step trains: floating point, not batch-norm statistics (a dynamo
    export's: those it marks as parameters); in the order the graph first uses them (model
    order, as a PyTorch state dict has it)."""
    stats = set(statistics(model.graph))
    marked = parameters(model) if is_dynamo_export(model) else None
    first_use: dict[str, tuple[int, int]] = {}
    for index, node in enumerate(model.graph.node):
        for position, name in enumerate(node.input):
            first_use.setdefault(name, (index, position))
    names = [t.name for t in model.graph.initializer if is_float(t) and t.name not in stats
             and (marked is None or t.name in marked)]
    return sorted(names, key=lambda name: first_use.get(name, (len(model.graph.node), 0)))


RANDOM = {"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike",
          "Bernoulli", "Multinomial"}


def check_supported(graph: onnx.GraphProto, source: Path) -> None:
    """Every node's operator has a converter; else an error naming the ops and their nodes.
    A node that draws random numbers (a random op, a Dropout in training mode: an export with
    ``training=TrainingMode.TRAINING``) is refused: TVM converts Dropout as the identity, and a
    compiled step is deterministic."""
    known = set(_get_convert_map()) | BUILT_IN
    missing = [(n.op_type, n.name or n.output[0]) for n in graph.node if n.op_type not in known]
    if missing:
        listed = ", ".join(f"{op} (node {name!r})" for op, name in missing[:8])
        raise ConfigError(f"{source}: operators TVM's ONNX frontend cannot convert: {listed}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    for node in graph.node:
        training = node.op_type == "Dropout" and len(node.input) > 2 and bool(
            values.get(node.input[2], False)) and float(values.get(node.input[1], 0.5)) > 0
        if node.op_type in RANDOM or training:
            raise ConfigError(f"{source}: node {node.name or node.output[0]!r} ({node.op_type}) "
                              "draws random numbers in training mode; a compiled step is "
                              "deterministic: export the model with its dropout at 0, or in "
                              "eval mode where it has no batch norm to train")


class _Importer(ONNXGraphImporter):
    """TVM's importer with trainable initializers, training-mode batch norm, and a record of the
    ONNX node behind every Relax var it returns."""

    def __init__(self, shape_dict: dict, buffers: list[str], trained: list[str],
                 source="model"):
        super().__init__(shape_dict, "float32", keep_params_in_input=True, sanitize=True)
        self.source = source
        self.buffer_names = set(buffers)
        self.trained = set(trained)
        self.names: dict[str, tuple[str, str]] = {}  # relax name -> (kind, ONNX name)
        self.buffer_vars: dict[str, relax.Var] = {}
        self.updates: list[tuple[relax.Var, relax.Var]] = []
        self.produced: dict[relax.Var, str] = {}

    def _parse_graph_initializers(self, graph: onnx.GraphProto):
        taken: set[str] = set()
        for tensor in graph.initializer:
            array = self._parse_array(tensor)
            if not is_float(tensor) or not (tensor.name in self.trained
                                            or tensor.name in self.buffer_names):
                self._nodes[tensor.name] = relax.const(array)  # a graph constant
                continue
            var = self._new_var(identifier(tensor.name, taken), shape=array.shape,
                                dtype=array.dtype)
            self._nodes[tensor.name] = var
            if tensor.name in self.buffer_names:  # inputs after the parameters
                self.buffer_vars[tensor.name] = var
                self.names[var.name] = ("buffer", tensor.name)
            else:
                self._params[var.name] = (var, array)
                self.names[var.name] = ("parameter", tensor.name)

    def _convert_operator(self, op_name, inputs, attrs, opset):
        node = attrs["tvm_custom"]["name"]
        if op_name == "BatchNormalization":
            value = self._batch_norm(inputs, attrs)
        elif op_name == "Clip" and (bounds := _constant_bounds(inputs, attrs)):
            # TVM emits Clip as TE kernels (no gradient); with constant bounds it is R.clip.
            value = self.bb.emit(relax.op.clip(inputs[0], *bounds))
        else:
            try:
                value = super()._convert_operator(op_name, inputs, attrs, opset)
            except (RuntimeError, ValueError) as err:  # TVM raises InternalError, a RuntimeError
                # TVM's importer fails on shapes it cannot compute ahead of time (a Reshape to
                # a shape the graph computes from a dynamic dimension, among others)
                raise ConfigError(
                    f"{self.source}: node {node!r} ({op_name}) cannot be converted: "
                    f"{str(err).strip().splitlines()[-1][:300]}; if the graph computes shapes "
                    "from a dynamic dimension, export with static shapes (torch.onnx.export "
                    "without dynamic_shapes / dynamic_axes)") from err
        if isinstance(value, relax.Call):  # bound here, so its var names this node
            value = self.bb.emit(value)
        if isinstance(value, relax.Var):
            self.produced[value] = f"{node} ({op_name})"
        return value

    def _batch_norm(self, inputs, attrs) -> relax.Var:
        x, gamma, beta, mean, var = inputs[:5]
        if not all(isinstance(v, relax.Var) and v in self.buffer_vars.values()
                   for v in (mean, var)):
            raise ConfigError(f"BatchNormalization {attrs['tvm_custom']['name']!r}: its running "
                              "statistics must be initializers of the model")
        # ONNX's momentum keeps the old statistic: new = m*old + (1-m)*batch.
        momentum = 1.0 - float(attrs.get("momentum", 0.9))
        out, new_mean, new_var = training_batch_norm(self.bb, x, gamma, beta, mean, var,
                                                     momentum, float(attrs.get("epsilon", 1e-5)))
        self.updates += [(mean, new_mean), (var, new_var)]
        return out


def _constant_bounds(inputs, attrs) -> tuple[float, float] | None:
    """Clip's (min, max) when both are absent or constants (attributes before opset 11)."""
    bounds = []
    for position, default in ((1, -math.inf), (2, math.inf)):
        name = "min" if position == 1 else "max"
        value = inputs[position] if len(inputs) > position else None
        if value is None:
            bounds.append(float(attrs.get(name, default)))
        elif isinstance(value, tvm.ir.expr.Constant) and value.value.numpy().size == 1:
            bounds.append(float(value.value.numpy()))
        else:
            return None
    return bounds[0], bounds[1]


def translate_onnx(model: onnx.ModelProto, source="model") -> tuple[relax.Function, dict, dict]:
    """``main``, the name table {relax name: (kind, ONNX name)} and the origin table {binding
    name: "node (OpType)"}, as torch_program.py gives them for a PyTorch program.
    ``model`` is ``prepare``d."""
    graph = model.graph
    check_supported(graph, source)
    shapes = {}
    for data in graph_inputs(model, source):
        shape = [d.dim_value if d.HasField("dim_value") else None
                 for d in data.type.tensor_type.shape.dim]
        if None in shape:
            raise ConfigError(f"{source}: input {data.name!r} has a dynamic dimension; "
                              "prepare() binds them")
        shapes[data.name] = shape
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = _Importer(shapes, statistics(graph), trainable(model), source)
    main = importer.from_onnx(graph, opset)["main"].with_attr("num_input", len(shapes))
    # The buffers join the inputs in the order their updates were met (the step returns them
    # in that order).
    func = with_buffers(main, importer.updates)
    names = {v.name: importer.names[v.name] for v in func.params[len(shapes):]}
    return func, names, origins_of(func, importer.produced)


def initial_values(model: onnx.ModelProto, names: dict) -> dict:
    """Initial value of every parameter and buffer, by Relax name (``model`` ``prepare``d)."""
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {relax: arrays[onnx_name] for relax, (_, onnx_name) in names.items()}
