"""new_W = update(W, grad) -> new_W = merge(W[not S], update(W[S], grad[S])), grad[S] from sliced operands.

Channel-sparse backpropagation: compute and apply only the selected slice of a gradient. After
pruning (prune_frozen.py: run it first), a parameter W that a scheme updates on channels S
(along axis a) still has its whole update in the step. This rewrites it to

    new_W       = merge(W[not S], update(W[S], grad[S], state[S]))    # other channels copied
    new_state   = the updated state slice                              # state shrinks to |S|

and computes grad[S] from sliced operands of the op that produces the gradient, never the
whole gradient followed by a slice:
  - weight-gradient conv2d (TVM's conv2d rule emits conv2d(x, dy) in CNHW/IOHW layouts):
    output channels slice dy (and, for a depthwise conv, x and the groups), input channels
    slice x;
  - matmul (a linear layer's weight gradient): slice the left or right operand;
  - collapse_sum_to (a bias gradient): slice its operand;
  - elementwise optimizer arithmetic (and an accumulating step's where), strided_slice and
    permute_dims pass the slice through.
Anything else (e.g. a batch-norm scale's reduction) is computed whole and then sliced; the
signature's ``channels`` say, per parameter, which way its slice was computed.

Before (W: 8 output channels, S = channels 0-1)::

    dW = matmul(permute_dims(dy), x)                          # (8, 16)
    new_m_W = 0.9 * m_W + dW                                  # m_W: (8, 16)
    new_W = W - lr * new_m_W

After::

    dy_S = strided_slice(dy, axes=[1], begin=[0], end=[2])
    dW_S = matmul(permute_dims(dy_S), x)                      # (2, 16): only the slice
    new_m_W = 0.9 * m_W + dW_S                                # m_W: (2, 16)
    W_S = strided_slice(W, [0], [0], [2]); W_kept = strided_slice(W, [0], [2], [8])
    new_W = concat([W_S - lr * new_m_W, W_kept], axis=0)
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from pipelines.ir import dtype_of, shape_of, signature_of, tensor_type, with_signature

ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power",
               "relax.sqrt", "relax.astype", "relax.negative", "relax.where"}


def _op_name(value) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        else ""


def _contiguous(index: list[int]) -> bool:
    return index == list(range(index[0], index[0] + len(index)))


class _Slicer:
    """Emits sliced versions of the step's values, memoised, appended after the block."""

    def __init__(self, func: relax.Function):
        self.defs = {b.var: b.value for b in func.body.blocks[0].bindings}
        self.bindings: list[relax.VarBinding] = []
        self.memo: dict = {}
        self.replaced: dict[relax.Var, relax.Var] = {}  # state inputs -> their sliced inputs
        self.fallbacks: list[str] = []
        self.builder = relax.BlockBuilder()

    def emit(self, value, name: str, output: bool = False) -> relax.Var:
        value = self.builder.normalize(value)
        var = (relax.Var if output else relax.DataflowVar)(name, value.ty)
        self.bindings.append(relax.VarBinding(var, value))
        return var

    def take(self, x, axis: int, index: list[int], name: str) -> relax.Var:
        """x restricted to ``index`` along ``axis``: a strided slice when the channels are
        contiguous, a gather otherwise."""
        if _contiguous(index):
            value = relax.op.strided_slice(x, [axis], [index[0]], [index[0] + len(index)])
        else:
            value = relax.op.take(x, relax.const(np.array(index, "int64")), axis, mode="clip")
        return self.emit(value, name)

    def sliced(self, var, axis: int, index: list[int]):
        key = (var, axis, tuple(index))
        if key not in self.memo:
            self.memo[key] = self._sliced(var, axis, index)
        return self.memo[key]

    def _sliced(self, var, axis: int, index: list[int]):
        name = f"{getattr(var, 'name', 'v')}_sliced"
        if var in self.replaced:
            return self.replaced[var]
        value = self.defs.get(var)
        op = _op_name(value)
        if value is None or not isinstance(var.ty, relax.TensorType):
            return self.take(var, axis, index, name)  # a step input, e.g. the weight itself
        full = shape_of(var)
        if op in ELEMENTWISE and all(shape_of(a) in ([], full) for a in value.args):
            # Scalars (learning rate, bias corrections) stay; full-shaped operands are sliced.
            args = [self.sliced(a, axis, index) if shape_of(a) == full else a
                    for a in value.args]
            return self.emit(relax.Call(value.op, args, value.attrs), name)
        elif op == "relax.nn.conv2d" and self._is_weight_grad(value):
            return self._conv_weight_grad(value, axis, index, name)
        elif op == "relax.matmul" and len(full) == 2:
            left, right = value.args
            if axis == 0:
                left = self.take(left, len(shape_of(left)) - 2, index, f"{name}_lhs")
            else:
                right = self.take(right, len(shape_of(right)) - 1, index, f"{name}_rhs")
            return self.emit(relax.op.matmul(left, right, value.attrs.out_dtype), name)
        elif op == "relax.collapse_sum_to":
            data = value.args[0]
            data_axis = len(shape_of(data)) - len(full) + axis
            if shape_of(data)[data_axis] == full[axis]:
                target = list(full)
                target[axis] = len(index)
                return self.emit(relax.op.collapse_sum_to(
                    self.take(data, data_axis, index, f"{name}_in"), target), name)
        elif op == "relax.permute_dims":
            order = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None \
                else list(reversed(range(len(full))))
            return self.emit(relax.op.permute_dims(
                self.sliced(value.args[0], order[axis], index), order), name)
        elif op == "relax.strided_slice" and self._keeps_axis(value, axis, full):
            axes, begin, end, strides = self._slice_args(value)
            end = [len(index) if a == axis else e for a, e in zip(axes, end)]
            return self.emit(relax.op.strided_slice(
                self.sliced(value.args[0], axis, index), axes, begin, end, strides), name)
        # No rule pushes the slice into this op's operands: compute whole, then slice.
        self.fallbacks.append(f"{op or type(value).__name__} ({var.name})")
        return self.take(var, axis, index, name)

    @staticmethod
    def _is_weight_grad(call) -> bool:
        attrs = call.attrs
        return (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) == \
            ("CNHW", "IOHW", "CNHW")

    @staticmethod
    def _slice_args(call) -> tuple[list[int], ...]:
        """(axes, begin, end, strides) of a strided_slice call (TVM 0.27 passes them as
        tuple arguments, not attributes)."""
        ints = [[int(v.value) for v in arg.fields] for arg in call.args[1:]]
        axes, begin, end = ints[:3]
        return axes, begin, end, ints[3] if len(ints) > 3 else [1] * len(axes)

    def _keeps_axis(self, call, axis: int, full: list[int]) -> bool:
        """A strided_slice that leaves ``axis`` whole (as TVM's conv2d rule uses to crop)."""
        size = shape_of(call.args[0])[axis]
        for a, b, e, s in zip(*self._slice_args(call)):
            if a == axis and (b != 0 or s != 1 or e < size or size != full[axis]):
                return False
        return True

    def _conv_weight_grad(self, call, axis: int, index: list[int], name: str):
        """conv2d(x, dy) in CNHW/IOHW layouts computes dW (O, I/groups, kh, kw)."""
        data, grad = call.args
        attrs = call.attrs
        groups = int(attrs.groups)
        out_channels = shape_of(grad)[1]
        if axis == 0 and groups == 1:
            grad = self.take(grad, 1, index, f"{name}_dy")
        elif axis == 0 and groups == out_channels:
            # Depthwise: TVM lays x out as (groups * batch, 1, h, w), group-major.
            batch = shape_of(grad)[0]
            rows = [g * batch + n for g in index for n in range(batch)]
            data = self.take(data, 0, rows, f"{name}_x")
            grad = self.take(grad, 1, index, f"{name}_dy")
            groups = len(index)
        elif axis == 1 and groups == 1:
            data = self.take(data, 1, index, f"{name}_x")
        else:
            self.fallbacks.append(f"grouped conv2d weight gradient on axis {axis}")
            return self.take(self.emit(call, f"{name}_whole"), axis, index, name)
        return self.emit(relax.op.nn.conv2d(
            data, grad, strides=[int(s) for s in attrs.strides],
            padding=[int(p) for p in attrs.padding], dilation=[int(d) for d in attrs.dilation],
            groups=groups, data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW",
            out_dtype=_dtype_or_none(attrs.out_dtype)), name)


def _dtype_or_none(dtype) -> str | None:
    """A conv's out_dtype attribute as conv2d takes it: None where it is unset (an ONNX
    import leaves it None, the PyTorch one an empty dtype)."""
    text = "" if dtype is None else str(dtype)
    return text if text not in ("", "void") else None


def _sliced_updates(step: relax.Function, signature: dict,
                  channels: dict[str, dict]) -> tuple[relax.Function, dict, dict]:
    """Rewrite the pruned ``step`` so each parameter in ``channels`` (Relax name ->
    {"axis", "index"}) updates only those channels. Returns the step, its signature (with
    ``channels`` and the sliced optimizer-state shapes) and, per parameter, how its gradient
    slice is computed: "operands" (sliced before the gradient op) or "after: <ops>"."""
    if not channels:
        return step, dict(signature, channels={}), {}
    slicer = _Slicer(step)
    inputs = signature["inputs"]
    params = dict(zip(inputs, step.params))
    outputs = list(step.body.body.fields)
    out_index = {name: i for i, name in enumerate(signature["outputs"])}
    state_info = {n: dict(info) for n, info in signature["optimizer_state"].items()}
    new_params = list(step.params)
    how = {}
    for param, selection in channels.items():
        axis, index = selection["axis"], selection["index"]
        weight = params[param]
        full = shape_of(weight)
        sliced_shape = list(full)
        sliced_shape[axis] = len(index)
        for name, info in state_info.items():  # the state holds only the slice
            if info["param"] == param:
                var = relax.Var(name, tensor_type(sliced_shape, dtype_of(weight)))
                slicer.replaced[params[name]] = var
                new_params[inputs.index(name)] = var
                info["shape"] = sliced_shape
        before = len(slicer.fallbacks)
        for name, info in state_info.items():
            if info["param"] == param:
                i = out_index[f"new_{name}"]
                outputs[i] = slicer.emit(slicer.sliced(outputs[i], axis, index),
                                         f"new_{name}", output=True)
        i = out_index[f"new_{param}"]
        updated = slicer.sliced(outputs[i], axis, index)
        # Merge: the updated slice in place of its channels, the others copied unchanged.
        rest = [c for c in range(full[axis]) if c not in set(index)]
        kept = slicer.take(weight, axis, rest, f"{param}_kept")
        merged = relax.op.concat([updated, kept], axis)
        if index != list(range(len(index))):  # put the channels back in their places
            order = np.argsort(np.array(index + rest)).astype("int64")
            merged = relax.op.take(slicer.emit(merged, f"{param}_grouped"),
                                   relax.const(order), axis, mode="clip")
        outputs[i] = slicer.emit(merged, f"new_{param}", output=True)
        how[param] = ("operands" if len(slicer.fallbacks) == before
                      else "after: " + ", ".join(slicer.fallbacks[before:]))
    block = step.body.blocks[0]
    body = relax.SeqExpr([relax.DataflowBlock(list(block.bindings) + slicer.bindings)],
                         relax.Tuple(outputs))
    rewritten = relax.Function(new_params, relax.BlockBuilder().normalize(body))
    rewritten = relax.transform.DeadCodeElimination(["train_step"])(
        tvm.IRModule({"train_step": rewritten.with_attr("global_symbol", "train_step")})
    )["train_step"]
    new_signature = dict(signature, optimizer_state=state_info,
                         channels={p: dict(s) for p, s in channels.items()})
    return rewritten, new_signature, how


@tvm.transform.module_pass(opt_level=0, name="SliceChannelUpdates")
class SliceChannelUpdates:
    """Each parameter of ``channels`` (Relax name -> {"axis", "index"}) updated on those
    channels only; the signature's ``channels`` record them and how each slice is computed
    ("operands", or "after: <ops>")."""

    def __init__(self, channels: dict[str, dict]):
        self.channels = channels

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        step, signature, how = _sliced_updates(mod["train_step"], signature_of(mod),
                                               self.channels)
        signature["channels"] = {p: dict(c, gradient=how[p])
                                 for p, c in signature["channels"].items()}
        out = mod.clone()
        out["train_step"] = step
        return with_signature(out, signature)
