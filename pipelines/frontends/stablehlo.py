"""A JAX model -> the same Relax ``main`` the PyTorch path gives, through StableHLO and TVM's
StableHLO frontend:

    main(x, *parameters, *buffers) -> (logits, *new_buffers)

The import stage lowers ``apply(params, x)`` with ``jax.jit(...).lower`` to StableHLO text
(``stablehlo_text``); parameters are the leaves of the ``params`` tree under their paths joined
with "." ({"conv1": {"weight": ...}} -> "conv1.weight"), so schemes select them as they select
a PyTorch module's.

TVM 0.27's StableHLO importer reads only the simplest forms of several ops: it ignores
convolution and dot dimension numbers, broadcast dimensions and pooling padding, and handles one
function. Its elementwise converters are used as they are; the ops below are converted here
from their full attributes, calls (JAX keeps e.g. ``relu`` a function of its own) are followed
into their functions, and the type and attribute readers are written for jaxlib 0.10's MLIR
bindings, which the frontend's no longer match.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tvm import relax
from tvm.relax.frontend.stablehlo.stablehlo_translator import StableHLOImporter

from pipelines.frontends.graph import origins_of
from pipelines.io import save_arrays, write_json_atomic, write_text_atomic
from pipelines.ir import identifier
from pipelines.schema import ConfigError


def stablehlo_text(apply, params: dict, example: np.ndarray, buffers: dict | None = None
                   ) -> tuple[str, list[str], list[str]]:
    """``apply(params, x)`` lowered to StableHLO text (without source locations, so the text
    does not depend on where the model file lies), the names of its parameters in argument
    order, and the names of its buffers. With ``buffers`` (state the model updates itself, such
    as batch-norm moving statistics), ``apply(params, buffers, x)`` returns (logits, new
    buffers) and the program takes (*parameters, *buffers, x)."""
    import jax

    if buffers is None:
        module = jax.jit(apply).lower(params, example)
        buffer_names = []
    else:
        module = jax.jit(apply).lower(params, buffers, example)
        buffer_names = parameter_names(buffers)
    module = module.compiler_ir("stablehlo")
    return (module.operation.get_asm(enable_debug_info=False), parameter_names(params),
            buffer_names)


def parameter_names(params) -> list[str]:
    """The leaves of a parameter tree, in JAX's order, as their paths joined with "."."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, _ in leaves]


def parse(text: str):
    from jax._src.interpreters import mlir as jax_mlir

    return jax_mlir.ir.Module.parse(text, jax_mlir.make_ir_context())


def _ints(attr) -> list[int]:
    return [int(v) for v in attr]


DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
          "i1": "bool", "i8": "int8", "i32": "int32", "i64": "int64", "ui8": "uint8"}


class _Importer(StableHLOImporter):
    """TVM's importer (its elementwise converters) with the ops a training step needs read from
    their full attributes, its type and attribute readers written for jaxlib 0.10's MLIR
    bindings, and calls followed into their functions."""

    def __init__(self, functions: dict, source):
        super().__init__()
        self.functions = functions  # callee name -> its block
        self.source = source  # the file, for errors
        # Per function being converted (calls nest): SSA value name -> Relax expression.
        self.scopes: list[dict] = []

    @staticmethod
    def _convert_data_type(ty):
        from jaxlib.mlir import ir

        element = str(ir.ShapedType(ty).element_type) if isinstance(ty, ir.Type) else str(ty)
        if element not in DTYPES:
            raise NotImplementedError(f"element type {element}")
        return DTYPES[element]

    def get_shape(self, ty) -> list[int]:
        from jaxlib.mlir import ir

        shaped = ir.ShapedType(ty)
        if not shaped.has_static_shape:
            raise NotImplementedError("dynamic shapes: lower with concrete input shapes")
        return [int(d) for d in shaped.shape]

    def _attr2value(self, attr):
        from jaxlib.mlir import ir

        if isinstance(attr, (ir.IntegerAttr, ir.FloatAttr)):
            return attr.value
        if getattr(attr, "is_splat", False):
            return np.full(self.get_shape(attr.type), attr.get_splat_value().value).tolist()
        return np.asarray(attr).tolist()

    def retrieve_operands(self, node):
        return [self.scopes[-1][value.get_name()] for value in node.operands]

    def run(self, block, arguments: list, produced: dict) -> list:
        """Convert ``block``'s ops with its arguments bound to ``arguments``; its results."""
        scope = {argument.get_name(): value
                 for argument, value in zip(block.arguments, arguments)}
        self.scopes.append(scope)
        try:
            for index, op in enumerate(block.operations):
                name = op.operation.name
                if name in ("func.return", "stablehlo.return"):
                    return self.retrieve_operands(op)
                if name == "func.call":
                    callee = str(op.attributes["callee"]).lstrip("@")
                    values = self.run(self.functions[callee], self.retrieve_operands(op),
                                      produced)
                else:
                    try:
                        values = [self.convert_map[name](op)]
                    except NotImplementedError as err:  # a form of the op not converted
                        raise ConfigError(f"{self.source}: {name} (op #{index} of its function) "
                                          f"cannot be converted: {err}") from err
                for result, value in zip(op.results, values):
                    scope[result.get_name()] = value
                    if isinstance(value, relax.Var):
                        produced[value] = f"{name} #{index}"
        finally:
            self.scopes.pop()
        raise ValueError("a function without a return")

    def create_convert_map(self):
        super().create_convert_map()
        self.convert_map.update({
            "stablehlo.broadcast_in_dim": self._broadcast,
            "stablehlo.constant": self._constant,
            "stablehlo.convolution": self._conv,
            "stablehlo.dot_general": self._dot,
            "stablehlo.reduce": self._reduce_op,
            "stablehlo.reduce_window": self._pool,
            "stablehlo.transpose": self._transpose,
            "stablehlo.pad": self._pad,
            "stablehlo.tanh": self._unary(relax.op.tanh),
            "stablehlo.logistic": self._unary(relax.op.sigmoid),
            "stablehlo.log": self._unary(relax.op.log),
            "stablehlo.negate": self._unary(relax.op.negative),
            "stablehlo.abs": self._unary(relax.op.abs),
            "stablehlo.convert": self._convert,
            "stablehlo.compare": self._compare,
            "stablehlo.select": self._select,
            "chlo.square": lambda node: self._emit(relax.op.multiply(
                *(self.retrieve_operands(node) * 2))),
        })

    def _emit(self, expr):
        return self.block_builder.emit(expr)

    def _unary(self, op):
        return lambda node: self._emit(op(self.retrieve_operands(node)[0]))

    def _constant(self, node):
        value = np.asarray(self._attr2value(node.attributes["value"]),
                           self._convert_data_type(node.result.type))
        return relax.const(value.reshape(self.get_shape(node.result.type)))

    def _convert(self, node):
        value = self.retrieve_operands(node)[0]
        dtype = self._convert_data_type(node.result.type)
        if getattr(value, "value", None) is not None:  # a constant, folded (a pad's fill)
            return relax.const(value.value.numpy().astype(dtype))
        return self._emit(relax.op.astype(value, dtype))

    COMPARISONS = {"EQ": relax.op.equal, "NE": relax.op.not_equal, "LT": relax.op.less,
                   "LE": relax.op.less_equal, "GT": relax.op.greater,
                   "GE": relax.op.greater_equal}

    def _compare(self, node):
        lhs, rhs = self.retrieve_operands(node)
        direction = str(node.attributes["comparison_direction"]).split()[-1].rstrip(">")
        return self._emit(self.COMPARISONS[direction](lhs, rhs))

    def _select(self, node):
        condition, on_true, on_false = self.retrieve_operands(node)
        return self._emit(relax.op.where(condition, on_true, on_false))

    def _broadcast(self, node):
        """Operand axis i goes to result axis dims[i]; the other result axes are broadcast."""
        value = self.retrieve_operands(node)[0]
        dims = _ints(node.attributes["broadcast_dimensions"])
        operand_shape = self.get_shape(node.operands[0].type)
        shape = self.get_shape(node.result.type)
        order = sorted(range(len(dims)), key=lambda i: dims[i])
        if order != list(range(len(dims))):  # the operand's axes in result order first
            value = self._emit(relax.op.permute_dims(value, order))
        expanded = [1] * len(shape)
        for i in order:
            expanded[dims[i]] = operand_shape[i]
        if expanded != [operand_shape[i] for i in order]:
            value = self._emit(relax.op.reshape(value, expanded))
        return value if expanded == shape else self._emit(relax.op.broadcast_to(value, shape))

    def _transpose(self, node):
        value = self.retrieve_operands(node)[0]
        return self._emit(relax.op.permute_dims(value, _ints(node.attributes["permutation"])))

    def _conv(self, node):
        from jaxlib.mlir.dialects import stablehlo

        x, weight = self.retrieve_operands(node)
        numbers = stablehlo.ConvDimensionNumbers(node.attributes["dimension_numbers"])
        if len(numbers.input_spatial_dimensions) != 2:
            raise NotImplementedError("convolution: only 2-D convolutions are supported")

        def layout(batch, feature, spatial, letters):
            chars = [""] * (2 + len(spatial))
            chars[batch], chars[feature] = letters[0], letters[1]
            for dim, letter in zip(spatial, "HW"):
                chars[dim] = letter
            return "".join(chars)

        data = layout(numbers.input_batch_dimension, numbers.input_feature_dimension,
                      numbers.input_spatial_dimensions, "NC")
        kernel = layout(numbers.kernel_output_feature_dimension,
                        numbers.kernel_input_feature_dimension,
                        numbers.kernel_spatial_dimensions, "OI")
        out = layout(numbers.output_batch_dimension, numbers.output_feature_dimension,
                     numbers.output_spatial_dimensions, "NC")
        attrs = node.attributes
        spatial = 2

        def window(name, default):
            return _ints(attrs[name]) if name in attrs else [default] * spatial

        reversed_window = "window_reversal" in attrs and any(attrs["window_reversal"])
        if (window("lhs_dilation", 1) != [1, 1] or int(attrs["batch_group_count"].value) != 1
                or reversed_window):
            raise NotImplementedError("convolution: transposed (lhs-dilated), batch-grouped and "
                                      "window-reversed convolutions are not supported")
        pad = (np.asarray(self._attr2value(attrs["padding"])).reshape(spatial, 2).tolist()
               if "padding" in attrs else [[0, 0], [0, 0]])
        # In NCHW/OIHW, the layouts Relax's conv2d gradient takes; channels-last models (Keras)
        # get transposes around the convolution.
        y = self._emit(relax.op.nn.conv2d(
            self._relayout(x, data, "NCHW"), self._relayout(weight, kernel, "OIHW"),
            strides=window("window_strides", 1),
            padding=[pad[0][0], pad[1][0], pad[0][1], pad[1][1]],
            dilation=window("rhs_dilation", 1),
            groups=int(attrs["feature_group_count"].value)))
        return self._relayout(y, "NCHW", out)

    def _relayout(self, value, source: str, target: str):
        """``value`` with axes named by ``source`` (e.g. "NHWC") permuted to ``target``."""
        if source == target:
            return value
        return self._emit(relax.op.permute_dims(value, [source.index(c) for c in target]))

    def _dot(self, node):
        """dot_general as one matmul: each side is permuted to (batch, free, contracting) /
        (batch, contracting, free) and flattened to three axes, or two without batch axes."""
        from jaxlib.mlir.dialects import stablehlo

        lhs, rhs = self.retrieve_operands(node)
        numbers = stablehlo.DotDimensionNumbers(node.attributes["dot_dimension_numbers"])
        lb, lc = list(numbers.lhs_batching_dimensions), list(numbers.lhs_contracting_dimensions)
        rb, rc = list(numbers.rhs_batching_dimensions), list(numbers.rhs_contracting_dimensions)
        ls, rs = self.get_shape(node.operands[0].type), self.get_shape(node.operands[1].type)
        lf = [d for d in range(len(ls)) if d not in lb + lc]
        rf = [d for d in range(len(rs)) if d not in rb + rc]

        def size(shape, dims):
            return int(np.prod([shape[d] for d in dims])) if dims else 1

        def arrange(value, shape, order, dims):
            if order != list(range(len(shape))):
                value = self._emit(relax.op.permute_dims(value, order))
            if [shape[d] for d in order] != dims:
                value = self._emit(relax.op.reshape(value, dims))
            return value

        b, m, k, n = size(ls, lb), size(ls, lf), size(ls, lc), size(rs, rf)
        batch = [b] if lb else []  # a plain product stays two-dimensional
        left = arrange(lhs, ls, lb + lf + lc, [*batch, m, k])
        right = arrange(rhs, rs, rb + rc + rf, [*batch, k, n])
        product = self._emit(relax.op.matmul(left, right))
        shape = self.get_shape(node.result.type)
        return product if [*batch, m, n] == shape else self._emit(relax.op.reshape(product, shape))

    def _body_op(self, node) -> str:
        return node.regions[0].blocks[0].operations[0].operation.name

    def _reduce_op(self, node):
        value, init = self.retrieve_operands(node)
        dims = _ints(node.attributes["dimensions"])
        reducer = self._body_op(node)
        ops = {"stablehlo.add": (relax.op.sum, 0.0), "stablehlo.maximum": (relax.op.max, -np.inf)}
        if reducer not in ops:
            raise NotImplementedError(f"reduce with {reducer}: only add and maximum")
        op, identity = ops[reducer]
        if not _is_identity(init, identity):
            raise NotImplementedError(f"reduce with {reducer} from a non-identity init value")
        return self._emit(op(value, axis=dims))

    def _pad(self, node):
        """pad with a constant (Keras's ZeroPadding2D): low and high edges, no interior."""
        value, fill = self.retrieve_operands(node)
        attrs = node.attributes
        low, high = _ints(attrs["edge_padding_low"]), _ints(attrs["edge_padding_high"])
        interior = _ints(attrs["interior_padding"]) if "interior_padding" in attrs else []
        if any(interior) or min(low + high) < 0 or getattr(fill, "value", None) is None:
            raise NotImplementedError("pad: only a constant value on the edges, widths >= 0")
        widths = [w for pair in zip(low, high) for w in pair]
        return self._emit(relax.op.nn.pad(value, widths, "constant",
                                          float(fill.value.numpy())))

    def _pool(self, node):
        """reduce_window with maximum over two spatial axes: max pooling."""
        value, init = self.retrieve_operands(node)
        attrs = node.attributes
        rank = len(self.get_shape(node.operands[0].type))
        sizes = _ints(attrs["window_dimensions"])
        strides = _ints(attrs["window_strides"]) if "window_strides" in attrs else [1] * rank
        pad = (np.asarray(self._attr2value(attrs["padding"])).reshape(rank, 2).tolist()
               if "padding" in attrs else [[0, 0]] * rank)
        spatial = [d for d in range(rank) if sizes[d] != 1 or strides[d] != 1]
        dilated = any(_ints(attrs[name]) != [1] * rank
                      for name in ("window_dilations", "base_dilations") if name in attrs)
        if (self._body_op(node) != "stablehlo.maximum" or not _is_identity(init, -np.inf)
                or rank != 4 or len(spatial) > 2 or dilated):
            raise NotImplementedError("reduce_window: only undilated max pooling over two axes")
        layout = "NCHW" if spatial in ([2, 3], [2], [3], []) else "NHWC"
        axes = [2, 3] if layout == "NCHW" else [1, 2]
        pooled = self._emit(relax.op.nn.max_pool2d(  # NCHW: the layout its gradient takes
            self._relayout(value, layout, "NCHW"), pool_size=[sizes[a] for a in axes],
            strides=[strides[a] for a in axes],
            padding=[pad[axes[0]][0], pad[axes[1]][0], pad[axes[0]][1], pad[axes[1]][1]]))
        return self._relayout(pooled, "NCHW", layout)


def _is_identity(init, value: float) -> bool:
    data = getattr(init, "value", None)
    return data is not None and bool(np.all(data.numpy() == value))


def translate_stablehlo(text: str, names: list[str], source="model", buffers=()
                        ) -> tuple[relax.Function, dict, dict]:
    """``main``, the name table {relax name: (kind, parameter or buffer name)} and the origin
    table {binding name: "op #index"} from ``stablehlo_text``'s output."""
    module = parse(text)
    functions = {str(op.attributes["sym_name"]).strip('"'): op.regions[0].blocks[0]
                 for op in module.body.operations}
    block = functions["main"]
    importer = _Importer(functions, source)
    types = list(block.arguments.types)
    labels = [*names, *buffers]
    if len(types) != len(labels) + 1:
        raise ConfigError(f"{source}: the program takes {len(types)} arguments; expected the "
                          f"{len(names)} parameters, {len(buffers)} buffers and the input")
    known = set(importer.convert_map) | {"func.call", "func.return", "stablehlo.return"}
    unsupported = [f"{op.operation.name} (op #{index} of @{function})"
                   for function, b in functions.items()
                   for index, op in enumerate(b.operations) if op.operation.name not in known]
    if unsupported:
        raise ConfigError(f"{source}: StableHLO ops with no converter: "
                          + ", ".join(unsupported[:8])
                          + (f" and {len(unsupported) - 8} more" if len(unsupported) > 8 else ""))
    taken: set[str] = set()
    inputs, table = [], {}
    for index, ty in enumerate(types):
        label = labels[index] if index < len(labels) else "x"
        var = relax.Var(identifier(label, taken), relax.TensorType(
            importer.get_shape(ty), importer._convert_data_type(ty)))
        inputs.append(var)
        if index < len(labels):
            table[var.name] = ("parameter" if index < len(names) else "buffer", label)
    bb = importer.block_builder = relax.BlockBuilder()
    produced: dict = {}
    # main(x, *parameters, *buffers) -> (logits, *new buffers), as the other frontends give it.
    with bb.function("main", [inputs[-1], *inputs[:-1]]):
        with bb.dataflow():
            results = importer.run(block, inputs, produced)
            if len(results) != 1 + len(buffers):
                raise ConfigError(f"{source}: the program returns {len(results)} values; "
                                  f"expected the logits and {len(buffers)} new buffers")
            outputs = [bb.emit_output(value) for value in results]
        bb.emit_func_output(relax.Tuple(outputs))
    func = bb.get()["main"].with_attr("num_input", 1)
    return func, table, origins_of(func, produced)


def parameter_kinds(text: str, names: list[str]) -> dict[str, str]:
    """The layer kind of each parameter, from the op that uses it (through transposes and
    reshapes): a convolution's kernel is conv, conv_pointwise (1x1) or conv_depthwise (one input
    channel per group), a dot's operand linear. The module's other parameters (its bias) share
    its kind; a module with neither is "other"."""
    from jaxlib.mlir.dialects import stablehlo

    from pipelines.frontends.layers import module_and_role

    module = parse(text)
    block = next(op.regions[0].blocks[0] for op in module.body.operations
                 if str(op.attributes["sym_name"]).strip('"') == "main")
    origin = {block.arguments[i].get_name(): names[i] for i in range(len(names))}
    kinds: dict[str, str] = {}
    for op in block.operations:
        name = op.operation.name
        sources = [origin.get(v.get_name()) for v in op.operands]
        if name in ("stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert") and sources[0]:
            origin[op.results[0].get_name()] = sources[0]  # still that parameter
        elif name == "stablehlo.convolution" and sources[1]:
            numbers = stablehlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
            shape = list(op.operands[1].type.shape)
            spatial = [shape[d] for d in numbers.kernel_spatial_dimensions]
            if int(op.attributes["feature_group_count"].value) > 1:
                depthwise = shape[numbers.kernel_input_feature_dimension] == 1
                kinds[sources[1]] = "conv_depthwise" if depthwise else "conv"
            else:
                kinds[sources[1]] = "conv_pointwise" if spatial == [1, 1] else "conv"
        elif name == "stablehlo.dot_general":
            for source in sources:
                if source:
                    kinds[source] = "linear"
    by_module = {module_and_role(n)[0]: k for n, k in kinds.items()}
    return {n: kinds.get(n, by_module.get(module_and_role(n)[0], "other")) for n in names}


def write_stablehlo(apply, params, example, buffers: dict | None, kinds: dict | None,
                    blocks: list[str], naming: str, path: Path, out: Path) -> str:
    """The jax and keras frontends' import: ``apply`` lowered to StableHLO, written with its
    weights (weights.npz), which of them are buffers (state.json) and layers.json (``kinds``
    by parameter, or from the ops that use them; ``naming``: how layers.json reads paths)."""
    import jax

    from pipelines.frontends.layers import describe_parameters

    text, names, buffer_names = stablehlo_text(apply, params, np.asarray(example), buffers)
    values = [np.asarray(v) for v in jax.tree_util.tree_leaves(params)]
    state = [np.asarray(v) for v in jax.tree_util.tree_leaves(buffers or {})]
    write_text_atomic(out / "model.mlir", text)
    save_arrays(out / "weights.npz", dict(zip(names + buffer_names, values + state)))
    write_json_atomic(out / "state.json", {"parameters": names, "buffers": buffer_names})
    kinds = kinds or parameter_kinds(text, names)  # Keras says; for JAX, the ops using them
    layers = describe_parameters([(n, kinds.get(n, "other"), list(v.shape))
                                  for n, v in zip(names, values)], blocks, naming)
    write_json_atomic(out / "layers.json", layers)
    return f"imported {path}: {len(names)} parameters, {text.count(chr(10))} lines of StableHLO"


def read_stablehlo(imported: Path):
    """``main``, names, origins and initial values from write_stablehlo's files."""
    import json

    from pipelines.io import load_arrays

    path = imported / "model.mlir"
    state = json.loads((imported / "state.json").read_text())
    values = load_arrays(imported / "weights.npz")
    func, names, origins = translate_stablehlo(path.read_text(), state["parameters"], path,
                                               state["buffers"])
    return func, names, origins, {r: values[n] for r, (_, n) in names.items()}
