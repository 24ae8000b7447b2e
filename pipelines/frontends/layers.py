"""What sparse schemes select from: every parameter with its module path, layer kind and block,
for a PyTorch module or a model file of another frontend (the same layers.json either way)."""
from __future__ import annotations

import torch

from pipelines.patterns import module_matcher


def layer_kind(module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.Conv2d):
        if module.groups > 1 and module.groups == module.in_channels == module.out_channels:
            return "conv_depthwise"
        if module.kernel_size == (1, 1) and module.groups == 1:
            return "conv_pointwise"
        return "conv"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm,
                           torch.nn.GroupNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith(
            "Norm"):  # a model's own norms (RMSNorm, LlamaRMSNorm, ...)
        return "norm"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    return "other"


def class_kind(class_name: str, shape: list[int], groups: int = 1) -> str:
    """The layer kind of a parameter of a module known only by its class name (a saved
    program's nn_module_stack): ``layer_kind``'s reading, with the weight's ``shape`` and the
    convolution's ``groups``."""
    if class_name in ("Conv2d", "Conv1d", "Conv3d"):
        if groups > 1 and len(shape) > 1 and shape[1] == 1 and groups == shape[0]:
            return "conv_depthwise"
        if groups == 1 and shape[2:] == [1, 1]:
            return "conv_pointwise"
        return "conv"
    if class_name == "Linear":
        return "linear"
    if class_name.endswith("Norm") or class_name.startswith(("BatchNorm", "LayerNorm",
                                                             "GroupNorm", "RMSNorm")):
        return "norm"
    if class_name == "Embedding":
        return "embedding"
    return "other"


def tied_parameters(program) -> dict[str, str]:
    """{input name: the input name it is tied to}: parameters that are one tensor under two
    names (GPT-2's head and input embeddings). torch.export keeps each name as an input; a
    training step must update one tensor with the sum of both uses' gradients."""
    from torch.export.graph_signature import InputKind

    first, tied = {}, {}
    for spec in program.graph_signature.input_specs:
        if spec.kind is InputKind.PARAMETER:
            value = program.state_dict[spec.target]  # a loaded program: the storage is shared
            key = (value.data_ptr(), tuple(value.shape), value.stride())
            if key in first:
                tied[spec.arg.name] = first[key]
            else:
                first[key] = spec.arg.name
    return tied


def describe_program(program, patterns: list[str] = ()) -> dict:
    """layers.json for a saved torch.export program: its parameters under the program's names,
    each one's kind from the class of the module that used it (the graph's nn_module_stack;
    the module objects themselves are not saved)."""
    from torch.export.graph_signature import InputKind

    nodes = {node.name: node for node in program.graph.nodes}
    state = program.state_dict
    specs = [s for s in program.graph_signature.input_specs if s.kind is InputKind.PARAMETER]
    classes, groups = {}, {}  # module path -> class name, convolution groups
    for spec in specs:
        module = spec.target.rsplit(".", 1)[0] if "." in spec.target else ""
        for user in nodes[spec.arg.name].users:
            for path, kind in (user.meta.get("nn_module_stack") or {}).values():
                if path == module:
                    classes[module] = str(kind).rsplit(".", 1)[-1]
            if user.target is torch.ops.aten.conv2d.default and len(user.args) > 6:
                groups[module] = int(user.args[6])
            elif user.target is torch.ops.aten.convolution.default:
                groups[module] = int(user.args[8])
    tied, params = tied_parameters(program), []
    for spec in specs:
        if spec.arg.name in tied:
            continue  # tied (GPT-2's head): the step has it under its first name only
        module = spec.target.rsplit(".", 1)[0] if "." in spec.target else ""
        # a layer's kind is read from its weight (a bias's shape says nothing of the kernel)
        weight = state.get(f"{module}.weight" if module else "weight", state[spec.target])
        kind = class_kind(classes.get(module, ""), list(weight.shape), groups.get(module, 1))
        params.append((spec.target, kind, list(state[spec.target].shape)))
    return describe_parameters(params, patterns)


def describe_layers(model: torch.nn.Module, patterns: list[str] = ()) -> dict:
    """Per parameter: module path, layer kind, role (weight/bias), block index, shape. The
    blocks are the model's own ``blocks()`` if it has that method, else the module paths
    ``patterns`` match."""
    if callable(getattr(model, "blocks", None)):
        blocks = list(model.blocks())
    else:
        blocks = block_paths([path for path, _ in model.named_modules()], list(patterns))
    params, seen = [], set()
    for module_path, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # tied (GPT-2's head): the step has it under its first name only
            seen.add(id(param))
            block = next((i for i, b in enumerate(blocks)
                          if module_path == b or module_path.startswith(b + ".")), None)
            # a module's own tensors other than its bias (ViT's cls_token, position embeddings)
            # are weights, as schemes' ``update`` counts them
            name = f"{module_path}.{leaf}" if module_path else leaf  # the root's own
            params.append({"name": name, "module": module_path,
                           "kind": layer_kind(module), "role": "bias" if leaf == "bias" else
                           "weight", "block": block, "shape": list(param.shape)})
    return {"blocks": blocks, "parameters": params}


# Keras's and Flax's leaf names for what schemes call a weight or a bias.
BIAS_NAMES = {"bias", "beta"}


def module_and_role(name: str) -> tuple[str, str]:
    """"features.0.weight" -> ("features.0", "weight"): a parameter name's module path and its
    role, weight or bias (Keras's kernel and gamma are weights, beta a bias). Frontends give
    names with "." (ONNX from PyTorch, JAX trees) or "/" (Keras variable paths)."""
    parts = name.replace("/", ".").rsplit(".", 1)
    module, leaf = (parts[0], parts[1]) if len(parts) == 2 else ("", parts[0])
    return module, "bias" if leaf in BIAS_NAMES else "weight"


def onnx_kind(node) -> str:
    """The layer kind of the ONNX node that consumes a parameter."""
    if node.op_type == "Conv":
        attrs = {a.name: a for a in node.attribute}
        groups = attrs["group"].i if "group" in attrs else 1
        kernel = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else None
        if groups > 1:
            return "conv_depthwise"  # checked against the weight's shape by the caller
        return "conv_pointwise" if kernel == [1, 1] else "conv"
    return {"Gemm": "linear", "MatMul": "linear", "BatchNormalization": "norm",
            "LayerNormalization": "norm", "Gather": "embedding"}.get(node.op_type, "other")


def repeated_blocks(modules: list[str]) -> list[str]:
    """The blocks a model's names show when no pattern says: the numbered children of the
    shallowest module path that has at least two (model.layers.0, model.layers.1, ...:
    transformers' ModuleLists, a Sequential's stages)."""
    numbered: dict[str, list[str]] = {}
    for module in modules:
        parts = module.split(".")
        for end in range(1, len(parts)):
            if parts[end].isdigit():
                children = numbered.setdefault(".".join(parts[:end]), [])
                child = ".".join(parts[:end + 1])
                if child not in children:
                    children.append(child)
    candidates = [p for p, children in numbered.items() if len(children) >= 2]
    if not candidates:
        return []
    return numbered[min(candidates, key=lambda p: (p.count("."), modules.index(
        next(m for m in modules if m.startswith(p + ".")))))]


def block_paths(modules: list[str], patterns: list[str]) -> list[str]:
    """The blocks: each prefix of a module path that one of ``patterns`` (globs over module
    paths, e.g. "features.*", or "re:" and a regular expression) matches, in model order;
    without patterns, the repeated blocks the names show (``repeated_blocks``)."""
    if not patterns:
        return repeated_blocks(modules)
    matchers = [module_matcher(p) for p in patterns]
    blocks: list[str] = []
    for module in modules:
        parts = module.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if any(match(prefix) for match in matchers):
                if prefix not in blocks:
                    blocks.append(prefix)
                break
    return blocks


def describe_parameters(params: list[tuple[str, str, list[int]]], patterns: list[str],
                        layout: str = "torch") -> dict:
    """layers.json for a model of another frontend: ``params`` is (name, kind, shape) in model
    order; ``patterns`` say which module paths are blocks. ``layout`` "keras" marks kernels
    stored channels-last (HWIO convolutions, [in, out] dense), which channel rules refuse."""
    modules = [module_and_role(name)[0] for name, _, _ in params]
    blocks = block_paths(modules, patterns)
    described = []
    for (name, kind, shape), module in zip(params, modules):
        block = next((i for i, b in enumerate(blocks)
                      if module == b or module.startswith(b + ".")), None)
        described.append({"name": name, "module": module, "kind": kind,
                          "role": module_and_role(name)[1], "block": block,
                          "shape": list(shape)})
        if layout != "torch" and len(shape) > 1:
            described[-1]["layout"] = layout
    return {"blocks": blocks, "parameters": described}


def describe_onnx(model, parameters: list[str], patterns: list[str]) -> dict:
    """layers.json for an ONNX model; ``parameters`` are its trainable initializers' names."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    consumer = {}
    for node in model.graph.node:
        for name in node.input:
            consumer.setdefault(name, node)
    params = []
    for name in parameters:
        kind = onnx_kind(consumer[name]) if name in consumer else "other"
        shape = shapes[name]
        if kind == "conv_depthwise" and not (len(shape) == 4 and shape[1] == 1):
            kind = "conv"  # grouped, not one channel per group
        params.append((name, kind, shape))
    return describe_parameters(params, patterns)
