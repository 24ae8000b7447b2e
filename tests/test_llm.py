"""``experiment=llm``'s cases (docs/llm.md) at a reduced config, as CI can afford them: the
SmolLM-135M and Qwen2.5-0.5B architectures with 2 layers of their own widths (hidden size,
intermediate size, query and key-value heads), a 4096-token vocabulary and 32 tokens, seeded.
Every case of the experiment (full BP, the paper's transformer scheme, LoRA on q/v, Qwen2's
bias-only; AdamW), its frozen weights as the experiment stores them (bfloat16; int8 with a
scale per row in the paper cases; and two cases in float32 and float16), is built for the host and stepped 3 times beside PyTorch doing the same
update on the same rounded weights: the losses within 1e-4 relative, frozen weights
bit-identical, the trained set PyTorch's, and every trained tensor as close to PyTorch's in
float64 as PyTorch's own float32 step is. A frozen head (every case but full BP) takes its
logits and loss over chunks of 16 rows here (optimize.loss_chunk_rows;
transform/chunk_loss_rows.py), so those chunks are what is checked.

Why against float64, and why on steady elements (docs/llm.md, "Parity at a reduced size", has
the trace): AdamW steps each element by about lr * m / sqrt(v), a full step of the gradient's
sign wherever the gradient is not tiny. Where an element's gradient cancels to within float32
rounding of zero (Qwen2's key bias: softmax ignores a shift every score of a query shares; some
of a LoRA B's elements after the first step), its step's sign is the rounding's, in PyTorch
from itself in another summation order too, and such a flip moves the next steps' gradients of
every tensor a little. So each tensor is compared with the float64 step on its steady elements,
those whose float64 gradient was zero or at least 5% of the tensor's RMS at every step: the
compiled step's distance held to three times PyTorch float32's plus 1e-3 of the tensor's
change. The others are held to 2 lr per step (a sign flipped at every step) from PyTorch. A
wrong or missing update is off by about all of the change.

Each step updates its state in place: no new storage for any weight or moment. The PyTorch peer
that trains a case in a device's container (its program saved by torch.export, run by
pipelines/runtime/peer_in_container.py: here on this machine) trains qwen_full's tied embedding
as eager PyTorch does, and PEFT LoRA (the same peer's script) trains qwen_lora's adapters as the
host's PEFT peer does: three steps' losses within 1e-5.
The real-size runs are `pock compose experiment=llm && dvc repro`, never in the tests.
"""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tvm import relax

from conftest import assert_steps_match, compose_params, task_labels, twin_of

pytestmark = pytest.mark.slow

REDUCED = {"num_hidden_layers": 2, "vocab_size": 4096}
SEQUENCE = 32
STEPS = 3
CHUNK_ROWS = 16  # a frozen head's loss over chunks of rows (transform/chunk_loss_rows.py)


@pytest.fixture(scope="module")
def llm():
    """experiment=llm with both models reduced."""
    models = ("smollm", "qwen", "qwen_512")
    return compose_params("experiment=llm", *[
        f"+models.{model}.config.{key}={value}" for model in models
        for key, value in REDUCED.items()], *[
        f"models.{model}.dims.sequence={SEQUENCE}" for model in models],
        f"optimize.loss_chunk_rows={CHUNK_ROWS}")


CASES = ["smollm_full", "smollm_paper", "smollm_lora", "qwen_full", "qwen_paper", "qwen_lora",
         "qwen_bias_only", "qwen_lora_512"]
# the experiment stores frozen weights in bfloat16, the paper cases' in int8
# (optimize.frozen_dtype); these as well:
OTHER_DTYPES = [("smollm_paper", "float32"), ("qwen_lora", "float16")]


def test_the_experiment_names_every_case_tested_here(llm):
    assert sorted(llm.cases) == sorted(CASES)


@pytest.mark.parametrize("case, frozen_dtype", [(c, None) for c in CASES] + OTHER_DTYPES)
def test_each_llm_case_steps_like_pytorch_in_place(llm, build_case, case, frozen_dtype):
    from pipelines.config import case_optimize, case_optimizer
    from pipelines.models.pytorch import make_optimizer, selection_of, train_step

    compiled = build_case(llm, case, **({} if frozen_dtype is None
                                        else {"frozen_dtype": frozen_dtype}))
    signature = compiled.signature
    # stored in 16 bits: every weight no update writes (but one a product's float32 copy of
    # would cost more at the peak), and nothing else
    dtype = frozen_dtype or case_optimize(llm, llm.cases[case]).frozen_dtype
    data, count = len(signature["data"]), signature["num_params"]
    frozen = {p for p in signature["inputs"][data:data + count] if p not in signature["trainable"]}
    kept = set(compiled.plan["kept_float32"])
    assert kept <= frozen and len(kept) <= 1
    if dtype in ("bfloat16", "int8"):  # its products read it stored: no copy, none kept float32
        assert not kept and not _products_reading_copies(compiled.optimized.module)
        # nor its lookup: the embedding's rows are gathered stored and widened, not the table
        assert not _whole_copies(compiled.optimized.module, "model.embed_tokens.weight")
    axes = {p.name: len(p.ty.shape) for p in compiled.optimized.module["train_step"].params}
    narrower = {n for n in frozen - kept if dtype != "int8" or axes[n] >= 2}  # int8: by rows
    assert signature.get("stored_as", {}) == (
        {} if dtype == "float32" else dict.fromkeys(sorted(narrower), dtype))
    model, optimizer = llm.models[llm.cases[case].model], case_optimizer(llm, llm.cases[case])
    assert signature["data"] == ["input_ids", "labels"]
    # every trained tensor and its AdamW moments are written over their old values
    moments = {n for n, info in signature["optimizer_state"].items() if info["param"]}
    assert set(signature["updated_in_place"]) >= set(signature["trainable"]) | moments
    assert compiled.plan["outputs_bytes"] <= 8  # scalars: the loss, AdamW's step count
    # a frozen head's logits and loss one chunk of rows at a time; a trained head's all at once
    head_trained = "model.embed_tokens.weight" in {
        signature["source_names"][p] for p in signature["trainable"]}
    losses = [b for b in compiled.optimized.module["train_step"].body.blocks[0].bindings
              if isinstance(b.value, relax.Call) and "softmax_nll_loss" in str(b.value.args[0])]
    rows = int(np.prod(signature["data_types"]["input_ids"]["shape"]))
    assert len(losses) == (1 if head_trained else rows // CHUNK_ROWS)
    rng = np.random.default_rng(0)
    shape = signature["data_types"]["input_ids"]["shape"]
    batches = [(rng.integers(0, REDUCED["vocab_size"], shape).astype("int64"),
                task_labels("causal_lm", shape, rng, REDUCED["vocab_size"]))
               for _ in range(STEPS)]
    twin = twin_of(compiled, model)
    exact = twin_of(compiled, model).double()
    steps = make_optimizer(exact, optimizer, selection_of(signature))
    least = {}  # each element's smallest nonzero float64 gradient over the steps, in RMS
    for batch in batches:
        train_step(exact, steps, *batch, task=signature["task"])
        for name, param in exact.named_parameters():
            if param.grad is not None and param.grad.any():
                size = param.grad.abs() / param.grad.square().mean().sqrt()
                size[param.grad == 0] = torch.inf
                least[name] = torch.minimum(least.get(name, size), size)
    before, after = assert_steps_match(compiled, model, optimizer, batches, rtol=1e-4,
                                       atol=2 * optimizer.lr * STEPS, twin=twin)
    pytorch, float64 = twin.state_dict(), exact.state_dict()
    for name in [n for n in after if n in pytorch]:
        truth = float64[name].numpy()
        steady = least[name].numpy() >= 0.05 if name in least else np.ones(truth.shape, bool)
        ours = np.linalg.norm((after[name].numpy() - truth)[steady])
        theirs = np.linalg.norm((pytorch[name].numpy() - truth)[steady])
        change = np.linalg.norm((truth - before[name].numpy())[steady])
        assert ours <= 3 * theirs + 1e-3 * change, (
            f"{name}: its steady elements {ours:.3g} from the float64 step, PyTorch float32's "
            f"{theirs:.3g}, the change {change:.3g}")
    names = signature["source_names"]
    trained = {names[p] for p in signature["trainable"]}
    assert [n for n in trained if not torch.equal(before[n], after[n])], "nothing updated"


def _products_reading_copies(module) -> list[str]:
    """The product kernels of ``module``'s step that read a float32 copy of a stored weight
    (a kernel reading nothing but that weight made the operand: a widened copy, or one
    broadcast over a batched product's batch)."""
    from pipelines.ir import dtype_of
    from pipelines.kernels.gemm import GEMM

    step = module["train_step"]
    stored = {p.name for p in step.params if dtype_of(p) != "float32"}
    bound = relax.analysis.get_var2val(step)

    def kernel(value):
        return module[value.args[0].name_hint] if isinstance(value, relax.Call) and getattr(
            value.op, "name", "") == "relax.call_tir" else None

    copies = []
    for value in bound.values():
        func = kernel(value)
        if func is None or GEMM not in (func.attrs or {}):
            continue
        operand = value.args[1].fields[1]
        source = bound.get(operand)
        fields = [] if kernel(source) is None else list(source.args[1].fields)
        if len(fields) == 1 and getattr(fields[0], "name", None) in stored:
            copies.append(value.args[0].name_hint)
    return copies


def _whole_copies(module, weight: str) -> list[str]:
    """The bindings of ``module``'s step that hold ``weight`` (a source name) whole, widened
    to float32 from the dtype the step stores it in."""
    from pipelines.ir import dtype_of, shape_of, signature_of

    step = module["train_step"]
    names = signature_of(module)["source_names"]
    param = next(p for p in step.params if names.get(p.name) == weight)
    if dtype_of(param) == "float32":
        return []
    return [b.var.name for block in step.body.blocks for b in block.bindings
            if any(v.same_as(param) for v in relax.analysis.free_vars(b.value))
            and isinstance(b.var.ty, relax.TensorType) and dtype_of(b.var) == "float32"
            and list(shape_of(b.var)) == list(shape_of(param))]


def _llm_batch(compiled):
    rng = np.random.default_rng(0)
    shape = compiled.signature["data_types"]["input_ids"]["shape"]
    return (rng.integers(0, REDUCED["vocab_size"], shape).astype("int64"),
            task_labels("causal_lm", shape, rng, REDUCED["vocab_size"]))


def _run_container_script(tmp_path, plan: dict, batch: tuple) -> dict:
    """peer_in_container.py's results for tmp_path/program.pt2 trained by ``plan`` on
    ``batch``: the script alone in its directory, as in the container, on this machine."""
    from pipelines.runtime.device_io import PEER_IN_CONTAINER, SAMPLED_PEAK, save_inputs

    (tmp_path / "plan.json").write_text(json.dumps(plan))
    save_inputs(tmp_path / "inputs.npz", list(batch))
    for script in (PEER_IN_CONTAINER, SAMPLED_PEAK):
        shutil.copy(script, tmp_path / script.name)
    subprocess.run([sys.executable, str(tmp_path / PEER_IN_CONTAINER.name)] + [
        str(tmp_path / f) for f in ("program.pt2", "plan.json", "inputs.npz", "out.json")]
        + ["0", str(STEPS)], check=True)
    return json.loads((tmp_path / "out.json").read_text())


def test_the_container_peer_trains_tied_embeddings_as_eager_pytorch(llm, build_case, tmp_path):
    """torch.export gives the tied input and output embeddings back as two parameters sharing
    storage, of which the program reads one: that one is trained, or the peer's full BP would
    leave the embedding frozen (it did, until 2026-12-01)."""
    from pipelines.config import case_optimizer
    from pipelines.evaluate.container_peers import export_peer
    from pipelines.models.pytorch import make_optimizer, train_step

    compiled = build_case(llm, "qwen_full")
    model = llm.models[llm.cases["qwen_full"].model]
    optimizer = case_optimizer(llm, llm.cases["qwen_full"])
    batch = _llm_batch(compiled)
    plan = export_peer("torch_eager_full", model, compiled.signature, compiled.initial,
                       optimizer, batch, tmp_path / "program.pt2")
    assert any(len(names) > 1 for group in plan["groups"] for names in group["params"])
    got = _run_container_script(tmp_path, plan, batch)
    twin = twin_of(compiled, model)
    update = make_optimizer(twin, optimizer)
    here = [train_step(twin, update, *batch, task="causal_lm") for _ in range(STEPS)]
    assert got["losses"] == pytest.approx(here, rel=1e-5)


def test_peft_lora_trains_in_the_container_as_the_hosts_peer(llm, build_case, tmp_path):
    """PEFT LoRA exported for a device's container (board_8g's ``docker.peers``) trains what the
    host's PEFT peer trains, as it does: three steps' losses within 1e-5 of it, the first the
    compiled LoRA step's (both start from B = 0: the plain model's loss), and only the adapters
    trained, as many elements as the compiled step's."""
    from pipelines.config import case_optimizer
    from pipelines.evaluate.container_peers import export_peer
    from pipelines.models.pytorch import make_optimizer, train_step
    from pipelines.peers.peft_lora import peft_model
    from pipelines.runtime.step import CompiledStep

    compiled = build_case(llm, "qwen_lora")
    model = llm.models[llm.cases["qwen_lora"].model]
    optimizer = case_optimizer(llm, llm.cases["qwen_lora"])
    batch = _llm_batch(compiled)
    plan = export_peer("peft_lora", model, compiled.signature, compiled.initial, optimizer, batch,
                       tmp_path / "program.pt2")
    got = _run_container_script(tmp_path, plan, batch)
    peft, trainable = peft_model(model, compiled.signature, compiled.initial)
    assert trainable and all(".lora_" in name for name in trainable)
    update = make_optimizer(peft, optimizer, trainable)
    here = [train_step(peft, update, *batch, task="causal_lm") for _ in range(STEPS)]
    assert got["losses"] == pytest.approx(here, rel=1e-5)
    step = CompiledStep(compiled.directory, compiled.initial)
    loss = float(step.function(*step.arguments(*batch))[0].numpy())
    assert got["losses"][0] == pytest.approx(loss, rel=1e-5)
    assert got["trained"] == len(trainable)
    assert got["trained_elements"] == sum(compiled.initial[p].size
                                          for p in compiled.signature["trainable"])
