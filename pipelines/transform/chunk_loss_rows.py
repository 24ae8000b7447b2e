"""A frozen LM head's logits and loss taken over chunks of rows: one chunk's logits alive at a
time, not the whole batch's.

A language model's head multiplies each token's hidden state by the vocabulary: the logits are
rows x vocabulary floats (SmolLM's 512 x 49152: 96 MiB; Qwen2.5's 256 x 151936: 148 MiB), and
after the fused cross-entropy (kernels/softmax_nll.py) their gradient, written over them,
exists only to be multiplied back by the head. Rows do not mix there: row i's logits, loss and
gradient need only row i's hidden state and label. So where the head's weight is frozen (the
gradient reaches nothing but the hidden states), the product, the loss and the product back run
chunk by chunk, each chunk's logits dead before the next chunk's exist. A ``mean`` loss takes
the labels' count first: each chunk's gradient is then the whole batch's, bit for bit, and its
loss a partial sum. Run after FuseSoftmaxCrossEntropy; a pattern that differs in any way (the
head trained, another reader of the logits or their gradient) stays as it was.

Before::

    z = R.matmul(h, wt)                                         # rows x vocab
    fused = R.call_tir(softmax_nll_loss, (z, y, g), ...)        # mean over rows
    dz = fused[0]; loss = fused[1]
    dh = R.matmul(dz, w)

After (chunks of ``rows_per_chunk`` rows)::

    count = R.sum(R.astype(<y kept>, "float32")); scale = R.divide(g, count)
    h0 = R.strided_slice(h, [0], [0], [c]); y0 = R.strided_slice(y, [0], [0], [c])
    z0 = R.matmul(h0, wt)                                       # c x vocab
    fused0 = R.call_tir(softmax_nll_loss_sum, (z0, y0, scale), ...)
    dh0 = R.matmul(fused0[0], w)
    ...                                                         # the next chunks the same
    loss = R.divide(R.add(fused0[1], fused1[1], ...), count)
    dh = R.concat((dh0, dh1, ...), axis=0)
"""
from __future__ import annotations

import tvm
from tvm import relax

from pipelines.analysis.liveness import block_of, readers, uses
from pipelines.ir import dtype_of, op_name, shape_of, with_attrs_of
from pipelines.kernels.softmax_nll import IGNORE_ATTR, LOSS_KERNEL, softmax_nll_loss_kernel


def _loss_heads(mod: tvm.IRModule, func: relax.Function, rows_per_chunk: int) -> dict:
    """dh var -> what its chunked head needs, for each frozen head ``rows_per_chunk`` splits."""
    bindings = block_of(func).bindings
    position = {b.var: n for n, b in enumerate(bindings)}
    value = {b.var: b.value for b in bindings}
    users = readers(bindings)
    returned = set(uses(func.body.body))

    def single_reader(var):
        reading = users[var]
        return reading[0] if len(reading) == 1 and var not in returned else None

    def through_reshapes(var, backwards: bool):
        """``var`` followed through reshapes that only pass it on: (the end, what they were)."""
        passed = []
        while True:
            if backwards:
                if var not in value or op_name(value[var]) != "relax.reshape" \
                        or single_reader(var) is None:
                    return var, passed
                passed.append(var)
                var = value[var].args[0]
            else:
                nxt = single_reader(var)
                if nxt is None or op_name(value[nxt]) != "relax.reshape":
                    return var, passed
                passed.append(nxt)
                var = nxt

    found = {}
    for b in bindings:
        call = b.value
        if op_name(call) != "relax.call_tir":
            continue
        kernel = mod[call.args[0]]
        if LOSS_KERNEL not in (kernel.attrs or {}):
            continue
        z_arg, y, g = call.args[1].fields
        rows, vocab = shape_of(z_arg)
        if rows <= rows_per_chunk:
            continue
        z, z_reshapes = through_reshapes(z_arg, backwards=True)
        if op_name(value.get(z)) != "relax.matmul" or single_reader(z) is None \
                or shape_of(z) != [rows, vocab]:
            continue
        h, wt = value[z].args
        getters = {int(value[v].index): v for v in users[b.var]
                   if isinstance(value[v], relax.TupleGetItem)}
        if len(users[b.var]) != 2 or set(getters) != {0, 1} or b.var in returned:
            continue
        dz, dz_reshapes = through_reshapes(getters[0], backwards=False)
        dh = single_reader(dz)
        if dh is None or op_name(value[dh]) != "relax.matmul" \
                or not value[dh].args[0].same_as(dz) or shape_of(dz) != [rows, vocab]:
            continue  # the head trained (its gradient reads dz too), or another reader
        loss = getters[1]
        if any(position[v] < position[dh] for v in users[loss]):
            continue  # the loss is read before the chunks would stand
        found[dh] = {"h": h, "wt": wt, "w": value[dh].args[1], "labels": y, "adjoint": g,
                     "loss": loss, "rows": rows, "vocab": vocab,
                     "reduction": str(kernel.attrs[LOSS_KERNEL]),
                     "ignore_index": int(kernel.attrs[IGNORE_ATTR]),
                     "replaced": {z, *z_reshapes, b.var, *getters.values(), *dz_reshapes}}
    return found


@relax.expr_functor.mutator
class _ChunkedHead(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, found: dict, rows_per_chunk: int):
        super().__init__(mod)
        self.found, self.rows_per_chunk = found, rows_per_chunk
        self.replaced = set().union(*(f["replaced"] for f in found.values()))

    def visit_var_binding_(self, binding):
        if binding.var in self.replaced:
            return  # read only by the head's pattern
        head = self.found.get(binding.var)
        if head is None:
            return super().visit_var_binding_(binding)
        emit, op = self.builder_.emit, relax.op
        h, wt, w, y, g = (self.visit_expr(head[k]) for k in ("h", "wt", "w", "labels", "adjoint"))
        rows, vocab, ignore = head["rows"], head["vocab"], head["ignore_index"]
        if head["reduction"] == "mean":  # the rows the loss counts, as the fused kernel does
            label = lambda c: relax.const(c, dtype_of(y))  # noqa: E731
            kept = op.logical_and(op.not_equal(y, label(ignore)), op.logical_and(
                op.greater_equal(y, label(0)), op.less(y, label(vocab))))
            count = emit(op.sum(op.astype(kept, "float32")), "loss_count")
            g = emit(op.divide(g, count), "loss_scale")
        kernels, losses, gradients = {}, [], []
        for start in range(0, rows, self.rows_per_chunk):
            end = min(start + self.rows_per_chunk, rows)
            if end - start not in kernels:
                kernels[end - start] = self.builder_.add_func(softmax_nll_loss_kernel(
                    end - start, vocab, "sum", ignore), "softmax_nll_loss_sum")
            rows_of = lambda x: emit(op.strided_slice(x, [0], [start], [end]))  # noqa: E731
            z = emit(op.matmul(rows_of(h), wt, out_dtype="float32"), "logits_chunk")
            chunk_type = relax.TensorType([end - start, vocab], "float32")
            fused = emit(relax.call_tir(kernels[end - start], [z, rows_of(y), g],
                                        [chunk_type, relax.TensorType([], "float32")]),
                         "softmax_nll_loss")
            losses.append(fused)
            gradients.append(emit(op.matmul(emit(relax.TupleGetItem(fused, 0)), w)))
        # The partial losses read after every chunk: FuseOps emits a fused group where its
        # first binding stood, with all it reads before it, so a sum read as the chunks go
        # would pull every chunk's logits ahead of the first chunk's product back.
        total = emit(relax.TupleGetItem(losses[0], 1))
        for fused in losses[1:]:
            total = emit(op.add(total, emit(relax.TupleGetItem(fused, 1))))
        if head["reduction"] == "mean":
            total = emit(op.divide(total, count))
        # the original vars, bound here: whatever read them reads the chunks' results
        self.builder_.emit_normalized(relax.VarBinding(head["loss"], total))
        self.builder_.emit_normalized(relax.VarBinding(binding.var,
                                                       emit(op.concat(gradients, axis=0))))


@tvm.transform.module_pass(opt_level=0, name="ChunkLossRows")
class ChunkLossRows:
    """Each frozen LM head of ``train_step`` over chunks of ``rows_per_chunk`` rows (above);
    0: as it is."""

    def __init__(self, rows_per_chunk: int):
        self.rows_per_chunk = rows_per_chunk

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.rows_per_chunk <= 0:
            return mod
        found = _loss_heads(mod, mod["train_step"], self.rows_per_chunk)
        if not found:
            return mod
        mutator = _ChunkedHead(mod.clone(), found, self.rows_per_chunk)
        rewritten = mutator.visit_expr(mod["train_step"])
        out = mutator.builder_.get()
        out.update_func(out.get_global_var("train_step"), rewritten)
        return with_attrs_of(mod, relax.transform.DeadCodeElimination(["train_step"])(out))
