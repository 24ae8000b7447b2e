"""A frozen float32 weight w -> an input stored as float16 or bfloat16, read through a float32 copy
made just before each reader: the step holds half the bytes for every weight it never updates.

Sparse backpropagation leaves most of a language model's weights frozen (SmolLM-135M's paper
scheme: 95% of its 513 MiB), and a frozen weight is only ever read. So it can be stored in the
16-bit float a released checkpoint already comes in (SmolLM's and Qwen2.5's are bfloat16), and
widened where it is read. The widened copy is made right before the binding that reads it and is
dead after it, so only the weights one binding reads are ever float32 at a time; readers of the
same weight in a row (a chunked LM head's products) share one copy. An elementwise or gathering
reader (a norm's scale, the embedding's lookup) fuses the widening into its own kernel and never
makes the copy; a product on OpenBLAS reads it. The arithmetic stays float32, so the step
computes exactly what float32 PyTorch computes on the rounded weights: the PyTorch twin starts
from those values (``stored_weights.as_stored``). A product's copy costs the weight's float32
size while it runs: for a tied LM head (SmolLM's embedding, 108 MiB) more at the peak than half
its storage saves, so the optimize phase also plans the step with the largest weight left
float32 and keeps the lower plan (pipelines/compile.py). Run after IsolateGemms (whose products
read the weight itself, not a reshaped copy), before legalization.

Before (w frozen, float32)::

    def train_step(x, labels, w, ...):
        y = R.call_tir(gemm_nt, (x, w), ...)

After (``dtype`` float16)::

    def train_step(x, labels, w: R.Tensor((out, in), "float16"), ...):
        w_f32 = R.astype(w, "float32")
        y = R.call_tir(gemm_nt, (x, w_f32), ...)
"""
from __future__ import annotations

import math

import tvm
from tvm import relax

from pipelines.ir import dtype_of, shape_of, signature_of, with_signature
from pipelines.stored_weights import STORED_AS

DTYPES = ("float32", "float16", "bfloat16")  # float32: stored as they are


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, old: dict, new: dict):
        super().__init__(mod)
        self.old, self.new = old, new  # name -> the float32 parameter, the stored one
        self.live: dict = {}  # name -> the float32 copy the last reader read

    def visit_var_binding_(self, binding):
        read = {v.name for v in relax.analysis.free_vars(binding.value)
                if v.name in self.old and v.same_as(self.old[v.name])}
        if read and not read <= self.live.keys():
            self.live = {n: self.live.get(n) or self.builder_.emit(
                relax.op.astype(self.new[n], "float32"), f"{n}_f32") for n in sorted(read)}
        for name in read:
            self.set_var_remap(self.old[name], self.live[name])
        super().visit_var_binding_(binding)


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
    """``train_step``'s frozen weights but those in ``keep`` stored as ``dtype`` (one of DTYPES)
    and widened at each reader; the signature's ``stored_as`` names them. float32: the step as
    it was."""

    def __init__(self, dtype: str = "float32", keep=()):
        if dtype not in DTYPES:
            raise ValueError(f"frozen weights' dtype {dtype!r}; allowed: {list(DTYPES)}")
        self.dtype, self.keep = dtype, set(keep)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.dtype == "float32":
            return mod
        func, signature = mod["train_step"], signature_of(mod)
        names = set(stored_weights(signature, func)) - self.keep
        if not names:
            return mod
        old = {p.name: p for p in func.params if p.name in names}
        new = {n: relax.Var(n, relax.TensorType(shape_of(p), self.dtype)) for n, p in old.items()}
        mutator = _Widen(mod.clone(), old, new)
        body = mutator.visit_expr(func.body)
        widened = relax.Function([new.get(p.name, p) for p in func.params], body,
                                 func.ret_ty, func.is_pure, func.attrs)
        out = mutator.builder_.get()
        out.update_func(out.get_global_var("train_step"), widened)
        stored = {**signature.get(STORED_AS, {}), **{n: self.dtype for n in sorted(names)}}
        return with_signature(out, dict(signature, **{STORED_AS: stored}))
