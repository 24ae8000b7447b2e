"""The classifier loss and its gradient as one kernel: softmax cross-entropy.

Autodiff writes a cross-entropy loss as log_softmax, nll_loss, and for its gradient
nll_loss_backward, then log_softmax's rule: ``g - exp(log_softmax) * sum(g)``. Legalized and
fused, that is five passes over the logits, each a kernel of its own; on llama_tiny's logits
(512 x 2048) they took 1.2 ms of the transformer_paper step. The gradient has a closed form,

    dlogits[i, :] = (softmax(logits[i, :]) - onehot(y[i])) * g / count   (0 where y[i] is ignored
                                                                          or out of range)

with ``count`` the rows that are not ignored (``mean``) or 1 (``sum``), so one kernel reads each
row of logits once into cache and writes its gradient:
pipelines/transform/fuse_softmax_cross_entropy.py puts it in.
"""
from __future__ import annotations

from tvm import s_tir, te, tirx

from pipelines.ir import OPAQUE

LOSS_KERNEL = "pockengine_softmax_nll_loss"  # PrimFunc attribute: the reduction, mean or sum
IGNORE_ATTR = "pockengine_ignore_index"  # PrimFunc attribute: the label that scores nothing
LANES = 16  # partial results per row (below): a CPU's float32 vector, in two AVX2 registers


def softmax_nll_loss_kernel(rows: int, classes: int, reduction: str,
                            ignore_index: int) -> tirx.PrimFunc:
    """(logits, labels, loss adjoint) -> (logits' gradient, loss), as described above."""
    z = te.placeholder((rows, classes), "float32", "logits")
    y = te.placeholder((rows,), "int64", "labels")
    g = te.placeholder((), "float32", "loss_adjoint")
    zero, one = tirx.const(0.0, "float32"), tirx.const(1.0, "float32")
    # A label out of range scores nothing, as an ignored one does, and is never used as an
    # index: the runners refuse such batches (runtime/checks.py); the kernel does not read
    # out of bounds if one gets here.
    kept = lambda i: tirx.all(y[i] != ignore_index, y[i] >= 0, y[i] < classes)  # noqa: E731
    label = lambda i: tirx.Select(kept(i), y[i], tirx.const(0, "int64")).astype(  # noqa: E731
        "int32")
    # Each row's max and sum of exponentials in two steps: LANES partial results, lane l over
    # classes l, l + LANES, ... (past the last class: -inf, whose exponential adds 0), then
    # those combined. A CPU computes the partial results in vector lanes.
    width = -(-classes // LANES)

    def logit(i, j, lane):
        if classes % LANES == 0:
            return z[i, j * LANES + lane]
        return tirx.Select(j * LANES + lane < classes, z[i, j * LANES + lane],
                           tirx.const(float("-inf"), "float32"))

    j = te.reduce_axis((0, width), "j")
    lane_max = te.compute((rows, LANES), lambda i, lane: te.max(logit(i, j, lane), axis=j),
                          name="lane_max")
    lane = te.reduce_axis((0, LANES), "lane")
    row_max = te.compute((rows,), lambda i: te.max(lane_max[i, lane], axis=lane), name="row_max")
    j = te.reduce_axis((0, width), "j")
    lane_sum = te.compute(
        (rows, LANES), lambda i, lane: te.sum(te.exp(logit(i, j, lane) - row_max[i]), axis=j),
        name="lane_sum")
    lane = te.reduce_axis((0, LANES), "lane")
    row_sum = te.compute((rows,), lambda i: te.sum(lane_sum[i, lane], axis=lane), name="row_sum")
    if reduction == "mean":
        r = te.reduce_axis((0, rows), "r")
        count = te.compute((), lambda: te.sum(tirx.Select(kept(r), one, zero), axis=r),
                           name="count")
        scale = te.compute((), lambda: g[()] / count[()], name="scale")
    else:
        scale = g
    # softmax * scale = exp(z - max) * (scale / sum): a multiply per class, not a division.
    # An ignored row's scales are 0: no branch per class (it kept LLVM from vectorising).
    row_scale = te.compute((rows,), lambda i: tirx.Select(kept(i), scale[()] / row_sum[i], zero),
                           name="row_scale")
    label_scale = te.compute((rows,), lambda i: tirx.Select(kept(i), scale[()], zero),
                             name="label_scale")
    gradient = te.compute(
        (rows, classes), lambda i, k: te.exp(z[i, k] - row_max[i]) * row_scale[i]
        - tirx.Select(k == label(i), label_scale[i], zero), name="logits_gradient")
    row_loss = te.compute(
        (rows,), lambda i: tirx.Select(kept(i), row_max[i] + te.log(row_sum[i])
                                       - z[i, label(i)], zero), name="row_loss")
    r = te.reduce_axis((0, rows), "r")
    total = te.compute((), lambda: te.sum(row_loss[r], axis=r), name="total")
    loss = (te.compute((), lambda: total[()] / count[()], name="loss") if reduction == "mean"
            else total)
    func = te.create_prim_func([z, y, g, gradient, loss]).without_attr("global_symbol")
    # Each row's loss (it reads the row's labelled logit) just before its gradient, which may
    # be written over the logits (transform/loss_gradient_in_place.py); create_prim_func puts
    # it after: it orders the blocks by a walk from each output in turn.
    func = _moved_before(func, "row_loss", "logits_gradient")
    return func.with_attrs({LOSS_KERNEL: reduction, IGNORE_ATTR: ignore_index,
                            "op_pattern": OPAQUE})


def _moved_before(func: tirx.PrimFunc, name: str, before: str) -> tirx.PrimFunc:
    """``func`` with the loop nest of block ``name`` just before that of block ``before``
    (both directly under the root block, and ``name`` reading nothing ``before`` writes)."""
    root = func.body.block
    nests = list(root.body)

    def block_name(nest):  # the block under a nest of loops
        while isinstance(nest, tirx.For):
            nest = nest.body
        return nest.block.name_hint

    moved = next(n for n in nests if block_name(n) == name)
    nests.remove(moved)
    nests.insert(next(i for i, n in enumerate(nests) if block_name(n) == before), moved)
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt(nests), root.init, root.alloc_buffers, root.match_buffers,
                        root.annotations)
    realize = func.body
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, root))


def schedule_softmax_nll_loss(sch: s_tir.Schedule, vector: int) -> None:
    """Rows in parallel: each row's max, sum of exponentials and gradient computed one after
    the other while the row is in cache (one loop over the rows: merge), the lanes' partial
    results and the gradient ``vector`` lanes at a time. The rows' losses are summed after that
    loop."""
    blocks = [sch.get_sblock(name) for name in
              ("lane_max", "row_max", "lane_sum", "row_sum", "row_scale", "label_scale",
               "row_loss", "logits_gradient")]
    # merged where the last of them stood, the gradient: after what they read (the scale),
    # before what reads them (the total). parallel comes first: it checks that the blocks
    # under the loop are whole reductions.
    sch.parallel(sch.merge(*(sch.get_loops(block)[0] for block in blocks)))
    for name in ("lane_max", "lane_sum"):
        block = sch.get_sblock(name)
        _, lane, j = sch.get_loops(block)
        sch.decompose_reduction(block, lane)  # the initial values, then lanes innermost
        sch.reorder(j, lane)
        sch.unroll(lane)  # LLVM vectorises the unrolled lanes (vectorize refuses a reduction)
    _, k = sch.get_loops(sch.get_sblock("logits_gradient"))
    sch.vectorize(sch.split(k, [None, vector])[1])  # as the default schedules
