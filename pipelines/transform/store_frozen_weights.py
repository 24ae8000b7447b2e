"""A frozen float32 weight w -> an input stored narrower, read through a float32 copy made just
before each reader: the step holds a half or a quarter of the bytes for every weight it never
updates.

Sparse backpropagation leaves most of a language model's weights frozen (SmolLM-135M's paper
scheme: 95% of its 513 MiB), and a frozen weight is only ever read. So it can be stored in the
16-bit float a released checkpoint already comes in (SmolLM's and Qwen2.5's are bfloat16), or,
as QLoRA and LLM.int8 store a frozen base, in 8-bit integers with a float32 scale per row
(``int8``: every frozen weight of two or more axes, rows along its first; the scales are inputs
of their own, ``<name>__scale``, named by the signature's ``scales``; a 1-D weight stays
float32), and widened where it is read. The widened copy is made right before the binding that
reads it and is dead after it, so only the weights one binding reads are ever float32 at a time;
readers of the same weight in a row share one copy. An elementwise reader (a norm's scale) fuses
the widening into its own kernel and never makes the copy; a lookup (the embedding's ``take``, a
kernel TVM does not fuse into) gathers the stored rows and widens only those. A 2-D product that
reads a bfloat16 or int8 weight as its second operand, untransposed or transposed (every linear
layer's, and a tied LM head's both ways), reads it stored itself (kernels/gemm.py): no copy, and
on OpenBLAS the weight is widened a cache-sized tile at a time inside the call
(backend/openblas_sgemm.cc), not written out whole and read back; an int8 weight's scales are
the product's third operand, each row widened times its scale (no scaled copy of the product's
output or of its other operand, which for a tied LM head are a chunk of logits). A float16
weight's products, and those of other layouts, read a copy. The arithmetic stays float32, so the
step computes what float32 PyTorch computes on the stored weights: the PyTorch twin starts from
those values (``stored_weights.as_read``). A product's copy costs the weight's float32 size
while it runs: for a tied LM head (SmolLM's embedding, 108 MiB) more at the peak than half its
storage saves, so the optimize phase also plans the step with the largest weight left float32
and keeps the lower plan (pipelines/compile.py). Run after IsolateGemms (whose products read the
weight itself, not a reshaped copy), before legalization.

Before (w frozen, float32)::

    def train_step(x, labels, w, ...):
        y = R.call_tir(gemm_nt, (x, w), ...)

After (``dtype`` float16)::

    def train_step(x, labels, w: R.Tensor((out, in), "float16"), ...):
        w_f32 = R.astype(w, "float32")
        y = R.call_tir(gemm_nt, (x, w_f32), ...)

After (``dtype`` bfloat16; ``gemm_nt`` now reads a bfloat16 ``B``)::

    def train_step(x, labels, w: R.Tensor((out, in), "bfloat16"), ...):
        y = R.call_tir(gemm_nt, (x, w), ...)
        rows = R.take(embedding, tokens, axis=0)           # bfloat16 rows
        h = R.astype(rows, "float32")                      # not the whole embedding

After (``dtype`` int8; ``gemm_nt`` reads an int8 ``B`` and its rows' scales)::

    def train_step(x, labels, w: R.Tensor((out, in), "int8"), ...,
                   w__scale: R.Tensor((out,), "float32")):
        y = R.call_tir(gemm_nt, (x, w, w__scale), ...)     # w's row j times w__scale[j]
"""
from __future__ import annotations

import math

import tvm
from tvm import relax, tirx

from pipelines.ir import dtype_of, shape_of, signature_of, with_signature
from pipelines.kernels.gemm import GEMM, gemm_kernel
from pipelines.stored_weights import SCALES, STORED_AS, scale_name

DTYPES = ("float32", "float16", "bfloat16", "int8")  # float32: stored as they are
READ_STORED = ("bfloat16", "int8")  # what a product reads stored, widening it as it reads

DIRECT = ("nn", "nt")  # the layouts of a product whose second operand it reads stored


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, old: dict, new: dict, scales: dict):
        super().__init__(mod)
        self.mod, self.old, self.new = mod, old, new  # name -> the float32 parameter, the stored
        self.scales = scales  # name -> its rows' scales (an int8 weight's)
        self.live: dict = {}  # name -> the float32 copy the last reader read
        # (shapes, layout, dtype, scales' axis) -> the product kernel reading a weight stored
        self.kernels: dict = {}

    def _gemm(self, call) -> tirx.PrimFunc | None:
        """The product kernel ``call`` calls, or None."""
        if not isinstance(call, relax.Call) or getattr(call.op, "name", "") != "relax.call_tir":
            return None
        func = self.mod[call.args[0].name_hint]
        return func if isinstance(func, tirx.PrimFunc) and GEMM in (func.attrs or {}) else None

    def _stored(self, var) -> str | None:
        """The name of the stored weight ``var`` is (the float32 parameter), or None."""
        if isinstance(var, relax.Var) and var.same_as(self.old.get(var.name)):
            return var.name
        return None

    def _read_directly(self, value) -> set[str]:
        """The stored weight a 2-D product of layout DIRECT reads as its second operand (and
        not as its first), which it then reads stored: at most one name."""
        func = self._gemm(value)
        if func is None or str(func.attrs[GEMM]) not in DIRECT:
            return set()
        a, b = value.args[1].fields
        name = self._stored(b)
        if (name is None or dtype_of(self.new[name]) not in READ_STORED or a.same_as(b)
                or len(shape_of(b)) != 2 or len(shape_of(a)) != 2):
            return set()
        return {name}

    def _gathered(self, value) -> set[str]:
        """The stored weight a lookup (``take``) gathers rows from: its rows are gathered stored
        and widened, not the whole weight (an embedding's)."""
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.take"):
            return set()
        name = self._stored(value.args[0])
        if name is None or (name in self.scales and int(value.attrs.axis) != 0):
            return set()  # an int8 weight's scales are by row: only rows are gathered so
        return {name}

    def _widened(self, name: str) -> relax.Expr:
        """The whole of stored weight ``name`` in float32."""
        whole = relax.op.astype(self.new[name], "float32")
        if name not in self.scales:
            return whole
        rows = shape_of(self.new[name])
        scale = relax.op.reshape(self.scales[name], [rows[0], *[1] * (len(rows) - 1)])
        return relax.op.multiply(self.builder_.emit(whole, f"{name}_rows"), scale)

    def visit_var_binding_(self, binding):
        read = {v.name for v in relax.analysis.free_vars(binding.value)
                if self._stored(v) is not None}
        direct = self._read_directly(binding.value) | self._gathered(binding.value)
        widened = read - direct
        if widened and not widened <= self.live.keys():
            self.live = {n: self.live.get(n) or self.builder_.emit(self._widened(n), f"{n}_f32")
                         for n in sorted(widened)}
        for name in widened:
            self.set_var_remap(self.old[name], self.live[name])
        for name in direct:
            self.set_var_remap(self.old[name], self.new[name])
        super().visit_var_binding_(binding)

    def _scales_of(self, var) -> relax.Var | None:
        """The scales' input of the int8 weight input ``var`` is, or None."""
        name = getattr(var, "name", None)
        return self.scales.get(name) if var.same_as(self.new.get(name)) else None

    def visit_call_(self, original):
        call = super().visit_call_(original)
        if (getattr(call.op, "name", "") == "relax.take"
                and any(call.args[0].same_as(v) for v in self.new.values())):
            rows = relax.op.astype(self.builder_.emit(call, "rows"), "float32")
            scales = self._scales_of(call.args[0])
            if scales is None:
                return rows
            scale = relax.op.take(scales, call.args[1], axis=0)
            return relax.op.multiply(self.builder_.emit(rows, "rows_f32"),
                                     relax.op.expand_dims(scale, -1))
        func = self._gemm(call)
        if func is None:
            return call
        a, b = call.args[1].fields
        if dtype_of(b) == "float32":
            return call
        layout, scales = str(func.attrs[GEMM]), self._scales_of(b)
        # an int8 weight's rows are op(b)'s columns read transposed (x @ w.T), its rows if not
        axis = None if scales is None else ("n" if layout[1] == "t" else "k")
        key = (tuple(shape_of(a)), tuple(shape_of(b)), layout, dtype_of(b), axis)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(
                gemm_kernel(list(key[0]), list(key[1]), *key[2:]), f"gemm_{layout}")
        operands = [a, b] if scales is None else [a, b, scales]
        return relax.call_tir(self.kernels[key], operands, original.ty)


def stored_weights(signature: dict, func: relax.Function) -> list[str]:
    """The step's frozen float32 parameters (Relax names): none of them has an update."""
    data = len(signature["data"])
    params = signature["inputs"][data:data + signature["num_params"]]
    trainable = set(signature["trainable"])
    dtypes = {p.name: dtype_of(p) for p in func.params}
    return [p for p in params if p not in trainable and dtypes[p] == "float32"]


def largest_stored(mod: tvm.IRModule) -> str | None:
    """The largest weight ``mod``'s step stores narrower (by elements), or None."""
    stored = signature_of(mod).get(STORED_AS, {})
    sizes = {p.name: math.prod(shape_of(p)) for p in mod["train_step"].params if p.name in stored}
    return max(sorted(sizes), key=sizes.get, default=None)


@tvm.transform.module_pass(opt_level=0, name="StoreFrozenWeights")
class StoreFrozenWeights:
    """``train_step``'s frozen weights but those in ``keep`` stored as ``dtype`` (one of DTYPES;
    int8: those of two or more axes, each with its rows' scales as an input after the others)
    and widened at each reader; the signature's ``stored_as`` names them, and ``scales`` the
    int8 ones' scales. float32: the step as it was."""

    def __init__(self, dtype: str = "float32", keep=()):
        if dtype not in DTYPES:
            raise ValueError(f"frozen weights' dtype {dtype!r}; allowed: {list(DTYPES)}")
        self.dtype, self.keep = dtype, set(keep)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.dtype == "float32":
            return mod
        func, signature = mod["train_step"], signature_of(mod)
        old = {p.name: p for p in func.params
               if p.name in set(stored_weights(signature, func)) - self.keep
               and (self.dtype != "int8" or len(shape_of(p)) >= 2)}
        if not old:
            return mod
        new = {n: relax.Var(n, relax.TensorType(shape_of(p), self.dtype)) for n, p in old.items()}
        scales = ({n: relax.Var(scale_name(n), relax.TensorType([shape_of(p)[0]], "float32"))
                   for n, p in sorted(old.items())} if self.dtype == "int8" else {})
        mutator = _Widen(mod.clone(), old, new, scales)
        body = mutator.visit_expr(func.body)
        widened = relax.Function([new.get(p.name, p) for p in func.params] + list(scales.values()),
                                 body, func.ret_ty, func.is_pure, func.attrs)
        out = mutator.builder_.get()
        out.update_func(out.get_global_var("train_step"), widened)
        stored = {**signature.get(STORED_AS, {}), **{n: self.dtype for n in sorted(old)}}
        extra = {"inputs": signature["inputs"] + [v.name for v in scales.values()],
                 SCALES: {**signature.get(SCALES, {}), **{n: v.name for n, v in scales.items()}}
                 } if scales else {}
        return with_signature(out, dict(signature, **{STORED_AS: stored}, **extra))
