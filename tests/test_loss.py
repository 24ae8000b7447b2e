"""The fused cross-entropy (pipelines/transform/fuse_softmax_cross_entropy.py, its kernel and CPU
schedule pipelines/kernels/softmax_nll.py): autodiff's loss pattern becomes one kernel call,
which computes PyTorch's loss (rtol 1e-6) and gradient (rtol 1e-5, atol 1e-7), ignored labels
included; a pattern with another reader is left as it was. Where nothing reads the logits
after it, the kernel writes their gradient over them (transform/loss_gradient_in_place.py) and
computes the same; so does a frozen head taken over chunks of rows
(transform/chunk_loss_rows.py). And each task's loss (pipelines/training/loss.py) through a
whole step, against PyTorch's."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx

from pipelines.backend.cpu_schedules import schedule_cpu_kernels
from pipelines.tasks import IGNORE_INDEX
from pipelines.ir import signature_of, tensor_type, with_signature
from pipelines.kernels.softmax_nll import LOSS_KERNEL
from pipelines.transform import ChunkLossRows, FuseSoftmaxCrossEntropy, LossGradientInPlace

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _autodiff_pattern(rows: int, classes: int, reduction: str, extra_reader: bool = False):
    """The loss and its gradient as the autodiff stage writes them (log_softmax, nll_loss, its
    backward, log_softmax's rule); with ``extra_reader``, exp(log_softmax) is also returned."""
    z = relax.Var("z", tensor_type([rows, classes], "float32"))
    y = relax.Var("y", tensor_type([rows], "int64"))
    g = relax.Var("g", tensor_type([], "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("train_step", [z, y, g]):
        with bb.dataflow():
            p = bb.emit(op.nn.log_softmax(z))
            loss = bb.emit_output(op.nn.nll_loss(p, y, reduction=reduction,
                                                 ignore_index=IGNORE_INDEX))
            dp = bb.emit(op.grad.nll_loss_backward(g, p, y, reduction=reduction,
                                                   ignore_index=IGNORE_INDEX))
            e = bb.emit(op.exp(p))
            dz = bb.emit(op.subtract(dp, op.multiply(op.sum(dp, axis=[-1], keepdims=True), e)))
            out = bb.emit_output(relax.Tuple([loss, dz, e] if extra_reader else [loss, dz]))
        bb.emit_func_output(out)
    # The pass keeps the module's attributes (the step's signature travels as one).
    return with_signature(relax.transform.Normalize()(bb.get()), {"data": ["z", "y"]})


def fuse_losses(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """The pass applied, and how many fused loss calls the step makes."""
    fused = FuseSoftmaxCrossEntropy()(mod)
    kernels = {gv for gv, f in fused.functions.items()
               if isinstance(f, tirx.PrimFunc) and LOSS_KERNEL in (f.attrs or {})}
    calls = [b for block in fused["train_step"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op.same_as(tvm.ir.Op.get(
                 "relax.call_tir")) and b.value.args[0] in kernels]
    return fused, len(calls)


def _build(mod: tvm.IRModule):
    mod = relax.transform.LegalizeOps()(mod)
    schedule_cpu_kernels(mod)
    return relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())["train_step"]


@pytest.mark.parametrize("rows,classes,reduction", [(6, 10, "mean"), (5, 40, "sum"),
                                                     (9, 2048, "mean")])
def test_the_fused_loss_computes_pytorchs_cross_entropy_and_gradient(rows, classes, reduction):
    fused, count = fuse_losses(_autodiff_pattern(rows, classes, reduction))
    assert count == 1
    assert signature_of(fused) == {"data": ["z", "y"]}
    script = fused.script()
    assert "log_softmax" not in script and "nll_loss_backward" not in script
    rng = np.random.default_rng(rows)
    logits = (rng.standard_normal((rows, classes)) * 4).astype("float32")
    labels = rng.integers(0, classes, rows)
    labels[1] = IGNORE_INDEX
    adjoint = np.float32(0.7)
    loss, gradient = _build(fused)(*(tvm.runtime.tensor(a) for a in (
        logits, labels, np.array(adjoint))))

    z = torch.tensor(logits, requires_grad=True)
    want = torch.nn.functional.cross_entropy(z, torch.tensor(labels), ignore_index=IGNORE_INDEX,
                                             reduction=reduction)
    (want * float(adjoint)).backward()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=1e-6)
    np.testing.assert_allclose(gradient.numpy(), z.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert not gradient.numpy()[1].any()  # the ignored row


def test_a_pattern_with_another_reader_stays_as_it_was():
    mod = _autodiff_pattern(4, 10, "mean", extra_reader=True)
    fused, count = fuse_losses(mod)
    assert count == 0 and fused.same_as(mod)


def _logits_made_in_the_step(rows: int, features: int, classes: int, logits_returned: bool):
    """z = x @ w, its loss and autodiff's gradient pattern, and x's gradient dz @ w^T: the step
    makes the logits, as a model's head does; with ``logits_returned``, z is an output too."""
    x = relax.Var("x", tensor_type([rows, features], "float32"))
    w = relax.Var("w", tensor_type([features, classes], "float32"))
    y = relax.Var("y", tensor_type([rows], "int64"))
    g = relax.Var("g", tensor_type([], "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("train_step", [x, w, y, g]):
        with bb.dataflow():
            z = bb.emit(op.matmul(x, w))
            p = bb.emit(op.nn.log_softmax(z))
            loss = bb.emit(op.nn.nll_loss(p, y, ignore_index=IGNORE_INDEX))
            dp = bb.emit(op.grad.nll_loss_backward(g, p, y, ignore_index=IGNORE_INDEX))
            e = bb.emit(op.exp(p))
            dz = bb.emit(op.subtract(dp, op.multiply(op.sum(dp, axis=[-1], keepdims=True), e)))
            dx = bb.emit(op.matmul(dz, op.permute_dims(w)))
            out = bb.emit_output(relax.Tuple([loss, dx, z] if logits_returned else [loss, dx]))
        bb.emit_func_output(out)
    return relax.transform.Normalize()(bb.get())


@pytest.mark.parametrize("logits_returned", [False, True])
def test_the_logits_gradient_is_written_over_logits_nothing_reads_later(logits_returned):
    rows, features, classes = 6, 5, 40
    fused, count = fuse_losses(_logits_made_in_the_step(rows, features, classes,
                                                        logits_returned))
    assert count == 1
    step = LossGradientInPlace()(relax.transform.LegalizeOps()(fused))
    calls = [b.value.op.name for b in step["train_step"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and "softmax_nll_loss" in str(b.value.args[0])]
    assert calls == ["relax.call_tir" if logits_returned else "relax.call_tir_inplace"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, features)).astype("float32")
    w = (rng.standard_normal((features, classes)) * 2).astype("float32")
    labels = rng.integers(0, classes, rows)
    labels[2] = IGNORE_INDEX
    results = _build(step)(*(tvm.runtime.tensor(a) for a in (x, w, labels, np.array(
        np.float32(1.0)))))

    tx = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(tx @ torch.tensor(w), torch.tensor(labels),
                                             ignore_index=IGNORE_INDEX)
    want.backward()
    np.testing.assert_allclose(results[0].numpy(), want.item(), rtol=1e-6)
    np.testing.assert_allclose(results[1].numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-7)
    if logits_returned:  # the logits as they were: their gradient went to storage of its own
        np.testing.assert_allclose(results[2].numpy(), x @ w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows_per_chunk", [4, 5])
def test_a_frozen_head_over_chunks_of_rows_computes_the_same(rows_per_chunk):
    rows, features, classes = 10, 5, 40
    fused, _ = fuse_losses(_logits_made_in_the_step(rows, features, classes, False))
    step = LossGradientInPlace()(relax.transform.LegalizeOps()(ChunkLossRows(rows_per_chunk)(
        fused)))
    calls = [b.value.op.name for b in step["train_step"].body.blocks[0].bindings
             if isinstance(b.value, relax.Call) and "softmax_nll_loss" in str(b.value.args[0])]
    # one call a chunk (the last one shorter), each writing its gradient over its logits
    assert calls == ["relax.call_tir_inplace"] * -(-rows // rows_per_chunk)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, features)).astype("float32")
    w = (rng.standard_normal((features, classes)) * 2).astype("float32")
    labels = rng.integers(0, classes, rows)
    labels[[2, 9]] = IGNORE_INDEX
    loss, dx = _build(step)(*(tvm.runtime.tensor(a) for a in (x, w, labels, np.array(
        np.float32(1.0)))))
    whole = _build(LossGradientInPlace()(relax.transform.LegalizeOps()(fused)))(
        *(tvm.runtime.tensor(a) for a in (x, w, labels, np.array(np.float32(1.0)))))
    np.testing.assert_allclose(loss.numpy(), whole[0].numpy(), rtol=1e-6)
    np.testing.assert_array_equal(dx.numpy(), whole[1].numpy())  # the same scale, row by row
    tx = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(tx @ torch.tensor(w), torch.tensor(labels),
                                             ignore_index=IGNORE_INDEX)
    want.backward()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=1e-6)
    np.testing.assert_allclose(dx.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_head_whose_logits_are_read_again_or_that_fits_one_chunk_stays_as_it_was():
    fused, _ = fuse_losses(_logits_made_in_the_step(10, 5, 40, logits_returned=True))
    assert ChunkLossRows(4)(fused).same_as(fused)  # the logits are read again
    fused, _ = fuse_losses(_logits_made_in_the_step(10, 5, 40, logits_returned=False))
    assert ChunkLossRows(10)(fused).same_as(fused) and ChunkLossRows(0)(fused).same_as(fused)


@pytest.mark.parametrize("task,entry", [("causal_lm", "token_logits"),
                                        ("masked_lm", "token_logits"),
                                        ("regression", "regressor")])
def test_each_task_steps_like_pytorch_with_its_loss(tmp_path, host_profile, task, entry):
    """A model of each task's output shape, full BP, three SGD-momentum steps against PyTorch
    with the task's loss as PyTorch writes it (models/pytorch.py: task_loss): the loss and
    every weight within rtol 1e-4 (conftest.assert_steps_match). The token model's embedding
    has a padding_idx, which the batches use: that row stays as it was, as in PyTorch. The
    regressor's 0-d scale comes back 0-d."""
    from conftest import assert_steps_match, model_section, random_batch, task_labels

    from pipelines.compile import compile
    from pipelines.config import SGD

    model = model_section(frontend="torch", source="tests/frontends/task_heads.py", entry=entry,
                  batch_size=4, task=task)
    optimizer = SGD(kind="sgd", lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    compiled = compile(model, [{"modules": ["*"]}], optimizer, host_profile, tmp_path)
    assert compiled.signature["task"] == task
    rng = np.random.default_rng(1)
    labels = compiled.signature["data_types"]["labels"]
    batches = [random_batch(compiled, seed)[:-1] + (task_labels(task, labels["shape"], rng, 100),)
               for seed in range(3)]
    if task != "regression":  # padding tokens (id 0): PyTorch never updates their embedding
        for batch in batches:
            batch[0][:, :2] = 0
    _, after = assert_steps_match(compiled, model, optimizer, batches)
    if task == "regression":
        assert after["scale"].shape == ()


@pytest.mark.parametrize("task,shape", [("classification", [4, 3, 7]), ("causal_lm", [4, 7]),
                                        ("masked_lm", [2, 3, 4, 5])])
def test_an_output_the_task_cannot_score_is_named(task, shape):
    from pipelines.schema import ConfigError
    from pipelines.training.loss import loss_function

    with pytest.raises(ConfigError, match=rf"output is float32 of shape \{shape}.*task '{task}'"):
        loss_function(task, tensor_type(shape, "float32"))
