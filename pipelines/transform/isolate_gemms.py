"""R.matmul(a, permute_dims(b)) -> R.call_tir(gemm_nt, (a, b)): products as kernels of their own.

Matrix products as kernels of their own, so a device's build can switch them to a library.

Each float32 ``R.matmul`` whose operands have the same rank (2 or 3) and the same leading axes
becomes a call of a ``gemm_<XY>`` kernel: X and Y say whether the first and second operand is
read transposed (``n`` or ``t``), and a ``permute_dims`` that swaps an operand's last two axes is
folded into that reading instead of being materialised (also where torch.export's 4-D matmul put
a broadcast_to and a reshape to 3-D after it). A batched product whose second operand is one
matrix broadcast over the batch (torch.export's 3-D ``x @ w.T`` where x is not contiguous:
attention's output projection) becomes one 2-D product of x's rows merged (a reshape: no copy)
with the matrix itself, so no kernel writes the matrix out once per batch element, and a stored
weight is read as it is (store_frozen_weights.py). The kernel sums over k in the same order as
the legalized matmul. It is marked opaque, so fusion leaves it whole (no epilogue folded in):
the build either compiles it (default schedules) or, where a measurement on the device says
so, calls OpenBLAS in its place (backend/blas.py), found by the attribute ``GEMM``.

Before::

    wt = R.permute_dims(w, axes=[1, 0])
    y = R.matmul(x, wt)

After::

    y = R.call_tir(gemm_nt, (x, w), out_sinfo=R.Tensor((16, 32), "float32"))
"""
from __future__ import annotations

import math

import tvm
from tvm import relax

from pipelines.ir import op_name as _op_name, static_float32_shape as _static, with_attrs_of
from pipelines.kernels.gemm import gemm_kernel


def _swaps_last_two(call, rank: int) -> bool:
    axes = call.attrs.axes
    return axes is not None and [int(x) for x in axes] == [*range(rank - 2), rank - 1, rank - 2]


@relax.expr_functor.mutator
class _Gemms(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, bound: dict):
        super().__init__(mod)
        self.bound, self.kernels = bound, {}

    def _call(self, var, op: str):
        """The call of ``relax.<op>`` that ``var`` is bound to, or None."""
        value = self.bound.get(var)
        return value if _op_name(value) == f"relax.{op}" else None

    def _operand(self, var, rank: int):
        """(what to read, whether it is read transposed)."""
        value = self._call(var, "permute_dims")
        if value is not None and _static(value.args[0]) is not None and _swaps_last_two(
                value, rank):
            return value.args[0], "t"
        if rank == 3:
            return self._batched_operand(var)
        return var, "n"

    def _batched_operand(self, var):
        """A batched product from torch.export's 4-D matmul: ``reshape(broadcast_to(
        permute_dims(x)))``, the permute swapping x's last two axes, the broadcast to the
        shape it has, the reshape merging the leading axes. Read as x, its leading axes merged
        (a reshape: no copy), transposed; else as it is. In attention's query @ key^T, the
        kernel before the product then writes key, not key^T across its rows (llama_tiny's
        rotary embedding: 18 us a call, not 108)."""
        reshape = self._call(var, "reshape")
        broadcast = None if reshape is None else self._call(reshape.args[0], "broadcast_to")
        permute = None if broadcast is None else self._call(broadcast.args[0], "permute_dims")
        source = None if permute is None else _static(permute.args[0])
        if (source is None or len(source) < 3 or not _swaps_last_two(permute, len(source))
                or _static(broadcast) != _static(permute)
                or _static(reshape) != [math.prod(source[:-2]), source[-1], source[-2]]):
            return var, "n"
        merged = [math.prod(source[:-2]), *source[-2:]]
        return self.builder_.emit(relax.op.reshape(permute.args[0], merged)), "t"

    def _shared_matrix(self, var):
        """A batched operand that is one matrix m broadcast over the batch, ``broadcast_to(m)``
        or ``broadcast_to(permute_dims(m))``, either perhaps with its last two axes swapped by a
        permute_dims: (m, whether it is read transposed), else None."""
        outer = self._call(var, "permute_dims")
        flip = outer is not None and _swaps_last_two(outer, 3)
        broadcast = self._call(outer.args[0] if flip else var, "broadcast_to")
        shape = None if broadcast is None else _static(broadcast)
        source = None if shape is None else broadcast.args[0]
        if source is None or _static(source) is None or _static(source) != shape[1:]:
            return None  # a matrix the broadcast only repeats, not one it widens
        inner = self._call(source, "permute_dims")
        if inner is not None and _static(inner.args[0]) is not None and _swaps_last_two(inner, 2):
            return inner.args[0], "n" if flip else "t"
        return source, "t" if flip else "n"

    def _product(self, a, ta: str, b, tb: str, out_ty):
        key = (tuple(_static(a)), tuple(_static(b)), ta + tb)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(
                gemm_kernel(list(key[0]), list(key[1]), key[2]), f"gemm_{key[2]}")
        return relax.call_tir(self.kernels[key], [a, b], out_ty)

    def visit_call_(self, original):
        call = super().visit_call_(original)
        if getattr(call.op, "name", "") != "relax.matmul":
            return call
        shapes = [_static(arg) for arg in original.args]
        if (None in shapes or _static(original) is None or len(shapes[0]) != len(shapes[1])
                or len(shapes[0]) not in (2, 3) or shapes[0][:-2] != shapes[1][:-2]):
            return call
        rank = len(shapes[0])
        a, ta = self._operand(call.args[0], rank)
        shared = self._shared_matrix(call.args[1]) if rank == 3 and ta == "n" else None
        if shared is not None:  # the batch's rows against the one matrix
            (batch, rows, depth), out = _static(a), _static(original)
            merged = self.builder_.emit(relax.op.reshape(a, [batch * rows, depth]))
            product = self.builder_.emit(self._product(
                merged, "n", *shared, relax.TensorType([batch * rows, out[-1]], "float32")))
            return relax.op.reshape(product, out)
        b, tb = self._operand(call.args[1], rank)
        return self._product(a, ta, b, tb, original.ty)


@tvm.transform.module_pass(opt_level=0, name="IsolateGemms")
class IsolateGemms:
    """Each eligible matmul of ``train_step`` a gemm kernel call (above)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["train_step"]
        # A copy: the builder's module is updated in place, and ``mod`` is the caller's.
        mutator = _Gemms(mod.clone(), relax.analysis.get_var2val(func))
        rewritten = mutator.visit_expr(func)
        out = mutator.builder_.get()  # the module with the gemm kernels added
        out.update_func(out.get_global_var("train_step"), rewritten)
        # The folded permute_dims may now be unused: dead code elimination (fusion) drops them.
        return with_attrs_of(mod, out)
