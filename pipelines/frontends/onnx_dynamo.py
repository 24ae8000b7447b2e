"""ONNX files written by torch.onnx's dynamo exporter (torch 2.9+'s default), with the
state-dict names and parameters PyTorch had, as far as the file still holds them.

The exporter records what each value was: an initializer's ``InputSpec.kind`` (PARAMETER,
BUFFER), and, where its optimizer folded constants, the values a folded one came from
(``folded_from``); each node carries the FX node it came from. The default export
(``optimize=True``) then differs from the module in three ways, undone here:

- a Linear's weight is stored transposed, as ``val_NNN`` folded from the weight: it becomes an
  initializer of the weight's name and shape again, with a ``Transpose`` node in front;
- parameters with equal values (fresh LayerNorm weights, zero biases) are merged into one
  initializer: each use gets a copy under the name of the parameter its FX node read;
- a bias that was all zeros is left out of its Conv or Gemm: it comes back as zeros under
  its name;
- graph constants (a norm's epsilon, the causal mask) are float initializers too: only
  initializers of kind PARAMETER are trained.

What cannot be undone is named: a parameter folded into a constant with other values (BERT's
position embeddings looked up at fixed positions, ViT's class token expanded to the batch) is
not a parameter of the file and stays frozen; batch norm folded into a convolution is an error
with the export that keeps it. An ``optimize=False`` export keeps every name; its shape
arithmetic, which TVM's importer cannot read, is folded here with the parameters held out.
"""
from __future__ import annotations

import ast
import re

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipelines.schema import ConfigError

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED = "pkg.onnxscript.optimizer.folded_from"
FX_NODE = "pkg.torch.onnx.fx_node"
SCOPES = "pkg.torch.onnx.name_scopes"
# a parameter the FX node reads: its name lower-cased, dots made underscores
PLACEHOLDER = re.compile(r"%p_(\w+)")
EXPORT_ADVICE = ("export with torch.onnx.export(..., dynamo=True, optimize=False), which keeps "
                 "them (or dynamo=False)")


def metadata(props) -> dict[str, str]:
    return {p.key: p.value for p in props}


def value_kinds(graph: onnx.GraphProto) -> dict[str, dict[str, str]]:
    """Each value's exporter metadata, by name (value_info and graph inputs)."""
    return {v.name: metadata(v.metadata_props)
            for v in [*graph.value_info, *graph.input] if v.metadata_props}


def is_dynamo_export(model: onnx.ModelProto) -> bool:
    """Whether ``model`` says which initializers are parameters (a dynamo export does)."""
    return any(KIND in m for m in value_kinds(model.graph).values())


def parameters(model: onnx.ModelProto) -> set[str]:
    """The initializers a dynamo export marks as parameters."""
    kinds = value_kinds(model.graph)
    return {t.name for t in model.graph.initializer
            if kinds.get(t.name, {}).get(KIND) == "PARAMETER"}


def _mark(graph: onnx.GraphProto, name: str, tensor: onnx.TensorProto, kind: str) -> None:
    info = helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims))
    info.metadata_props.add(key=KIND, value=kind)
    graph.value_info.append(info)


def _read_parameters(node: onnx.NodeProto) -> list[str]:
    """The parameters ``node``'s FX node reads, by state-dict name: each placeholder
    ``p_<name lower-cased, dots as underscores>`` read back against the node's module scopes
    (deepest first), whose paths keep their dots and case (BERT's ``LayerNorm``)."""
    meta = metadata(node.metadata_props)
    scopes = [s for s in ast.literal_eval(meta.get(SCOPES, "[]")) if s]
    names = []
    for mangled in PLACEHOLDER.findall(meta.get(FX_NODE, "").split("](args", 1)[-1]):
        for scope in sorted(scopes, key=len, reverse=True):
            prefix = scope.replace(".", "_").lower() + "_"
            if mangled.startswith(prefix):
                names.append(f"{scope}.{mangled[len(prefix):]}")
                break
    return names


def _linear_weight(uses: list[tuple[onnx.NodeProto, int]]) -> bool:
    """Whether every use reads the value as a Linear's weight (MatMul's right operand)."""
    return bool(uses) and all(
        node.op_type == "MatMul" and position == 1
        and "aten.linear" in metadata(node.metadata_props).get(FX_NODE, "")
        for node, position in uses)


def restore_parameters(model: onnx.ModelProto, source) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` (a dynamo export) with its transposed weights and merged parameters back
    under their state-dict names, marked as parameters; and the parameters the export folded
    into constants (frozen: not in the file)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    _refuse_folded_batch_norm(graph, source)
    kinds = value_kinds(graph)
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, position))
    known = {n for n, t in inits.items() if kinds.get(n, {}).get(KIND) == "PARAMETER"}
    folded = {n: ast.literal_eval(kinds[n][FOLDED]) for n in inits if FOLDED in kinds.get(n, {})}
    transposed = {n: f[0] for n, f in folded.items()
                  if len(f) == 1 and f[0] not in inits and _linear_weight(uses.get(n, []))}
    known |= set(transposed.values())
    transposes = []
    for name, weight in transposed.items():
        tensor = inits.pop(name)
        graph.initializer.remove(tensor)
        restored = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(tensor).T),
                                           weight)
        graph.initializer.append(restored)
        inits[weight] = restored
        _mark(graph, weight, restored, "PARAMETER")
        transposes.append(helper.make_node("Transpose", [weight], [name], perm=[1, 0],
                                           name=f"{weight}.T"))
    for name in sorted(known - set(transposed.values())):
        _split_merged(graph, inits, name, uses.get(name, []), known)
    _restore_zero_biases(graph, inits, known)
    # nodes are in topological order: the transposes go first
    nodes = transposes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    lost = sorted({n for sources in folded.values() if len(sources) > 1 for n in sources
                   if "." in n and n not in known})
    return model, lost


def _split_merged(graph, inits: dict, name: str, uses: list, known: set[str]) -> None:
    """One initializer that several equal parameters were merged into: each use whose FX node
    read another parameter reads a copy under that parameter's name."""
    for node, position in uses:
        placeholders = _read_parameters(node)
        read = [n for n in placeholders if n == name or n not in known]
        if len(read) > 1:  # LayerNorm's scale and bias, both merged: the n-th param input
            held = [p for p, i in enumerate(node.input) if i in inits]
            read = ([placeholders[held.index(position)]] if len(held) == len(placeholders)
                    else [])
        if len(read) != 1 or read[0] == name:
            continue
        owner = read[0]
        if owner not in inits:
            copy = onnx.TensorProto.FromString(inits[name].SerializeToString())
            copy.name = owner
            graph.initializer.append(copy)
            inits[owner] = copy
            _mark(graph, owner, copy, "PARAMETER")
        node.input[position] = owner


def _restore_zero_biases(graph, inits: dict, known: set[str]) -> None:
    """A Conv's or Gemm's bias the FX node read and the export left out (the optimizer drops
    a bias of zeros): zeros under its name again, as the node's third input."""
    for node in graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) > 2:
            continue
        missing = [n for n in _read_parameters(node) if n not in known]
        weight = inits.get(node.input[1])
        if len(missing) != 1 or weight is None:
            continue
        transposed = node.op_type == "Gemm" and not any(
            a.name == "transB" and a.i for a in node.attribute)
        size = weight.dims[1] if transposed else weight.dims[0]
        bias = numpy_helper.from_array(np.zeros(size, numpy_helper.to_array(weight).dtype),
                                       missing[0])
        graph.initializer.append(bias)
        inits[bias.name] = bias
        known.add(bias.name)
        _mark(graph, bias.name, bias, "PARAMETER")
        node.input.append(bias.name)


def _refuse_folded_batch_norm(graph: onnx.GraphProto, source) -> None:
    """Batch norm the exporter folded into the convolution before it: its weights are the
    fused ones, its statistics gone; a step cannot train the module from them."""
    folded = [n.name or n.output[0] for n in graph.node if n.op_type != "BatchNormalization"
              and "batch_norm" in metadata(n.metadata_props).get(FX_NODE, "").split("](", 1)[0]]
    if folded:
        raise ConfigError(f"{source}: the exporter folded batch norm into {folded[:3]}"
                          f"{' and more' if len(folded) > 3 else ''}: its scale, shift and "
                          f"statistics are gone from the file; {EXPORT_ADVICE}")


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with what does not depend on its inputs or parameters folded (an
    ``optimize=False`` export's shape arithmetic): the parameters and buffers are held out as
    graph inputs while onnxscript's optimizer runs, so none is folded into a constant."""
    import onnxscript

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    kinds = value_kinds(graph)
    held = [t for t in graph.initializer if kinds.get(t.name, {}).get(KIND) in
            ("PARAMETER", "BUFFER")]
    count = len(graph.input)
    for tensor in held:
        graph.initializer.remove(tensor)
        graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type,
                                                         list(tensor.dims)))
    folded = onnxscript.optimizer.optimize(model)
    inputs = list(folded.graph.input)
    del folded.graph.input[:]
    folded.graph.input.extend(inputs[:count])
    marked = value_kinds(folded.graph)
    for tensor in held:
        folded.graph.initializer.append(tensor)
        if KIND not in marked.get(tensor.name, {}):
            _mark(folded.graph, tensor.name, tensor, kinds[tensor.name][KIND])
    return folded
