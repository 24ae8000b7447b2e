"""``experiment=llm``'s cases (docs/llm.md) at a reduced config, as CI can afford them: the
SmolLM-135M and Qwen2.5-0.5B architectures with 2 layers of their own widths (hidden size,
intermediate size, query and key-value heads), a 4096-token vocabulary and 32 tokens, seeded.
Every case of the experiment (full BP, the paper's transformer scheme, LoRA on q/v, Qwen2's
bias-only; AdamW) is built for the host and stepped 3 times beside PyTorch doing the same
update: the losses within 1e-4 relative, frozen weights bit-identical, the trained set
PyTorch's, and every trained tensor as close to PyTorch's in float64 as PyTorch's own float32
step is.

Why against float64: AdamW steps each element by about lr * m / sqrt(v). Where an element's
gradient is a sum that cancels to within float32 rounding of zero, its sign is the rounding's,
and the step is +lr or -lr on either side: Qwen2's key bias is all such elements (adding it
shifts every score of a query by the same q.b, which softmax ignores: its exact gradient is
zero), and so are many of the LoRA A weights after a first step whose gradient B = 0 zeroed.
Elementwise, two float32 implementations then differ by whole steps, PyTorch from itself in
another summation order too. So each tensor's distance to the float64 step, for the compiled
step, is held to twice PyTorch float32's plus 1e-4 of its norm; and no element further than
2 lr per step (its sign flipped at every step) from PyTorch. A wrong or missing update moves
every element.

Each step updates its state in place: no new storage for any weight or moment.
The real-size runs are `pock compose experiment=llm && dvc repro`, never in the tests.
"""
import numpy as np
import pytest
import torch

from conftest import assert_steps_match, compose_params, task_labels, twin_of

pytestmark = pytest.mark.slow

REDUCED = {"num_hidden_layers": 2, "vocab_size": 4096}
SEQUENCE = 32
STEPS = 3


@pytest.fixture(scope="module")
def llm():
    """experiment=llm with both models reduced."""
    return compose_params("experiment=llm", *[
        f"+models.{model}.config.{key}={value}" for model in ("smollm", "qwen")
        for key, value in REDUCED.items()], *[
        f"models.{model}.dims.sequence={SEQUENCE}" for model in ("smollm", "qwen")])


# Open (docs/llm.md, "Parity at a reduced size"): Qwen2's LoRA step is further from the float64
# step than PyTorch's float32 one, though its losses match; not yet traced. Not strict: one
# clean-clone CI run of the same code passed it (2026-11-27), the run before failed it.
QWEN_LORA = pytest.param("qwen_lora", marks=pytest.mark.xfail(
    strict=False, reason="Qwen2 LoRA: further from float64 than PyTorch float32 (docs/llm.md)"))
CASES = ["smollm_full", "smollm_paper", "smollm_lora", "qwen_full", "qwen_paper", QWEN_LORA,
         "qwen_bias_only"]


def test_the_experiment_names_every_case_tested_here(llm):
    assert sorted(llm.cases) == sorted(c if isinstance(c, str) else c.values[0] for c in CASES)


@pytest.mark.parametrize("case", CASES)
def test_each_llm_case_steps_like_pytorch_in_place(llm, build_case, case):
    from pipelines.config import case_optimizer
    from pipelines.models.pytorch import make_optimizer, train_step
    from pipelines.runtime.step import selection_of

    compiled = build_case(llm, case)
    signature = compiled.signature
    model, optimizer = llm.models[llm.cases[case].model], case_optimizer(llm, llm.cases[case])
    assert signature["data"] == ["input_ids", "labels"]
    # every trained tensor and its AdamW moments are written over their old values
    moments = {n for n, info in signature["optimizer_state"].items() if info["param"]}
    assert set(signature["updated_in_place"]) >= set(signature["trainable"]) | moments
    assert compiled.plan["outputs_bytes"] <= 8  # scalars: the loss, AdamW's step count
    rng = np.random.default_rng(0)
    shape = signature["data_types"]["input_ids"]["shape"]
    batches = [(rng.integers(0, REDUCED["vocab_size"], shape).astype("int64"),
                task_labels("causal_lm", shape, rng, REDUCED["vocab_size"]))
               for _ in range(STEPS)]
    twin = twin_of(compiled, model)
    exact = twin_of(compiled, model).double()
    steps = make_optimizer(exact, optimizer, selection_of(signature))
    for batch in batches:
        train_step(exact, steps, *batch, task=signature["task"])
    before, after = assert_steps_match(compiled, model, optimizer, batches, rtol=1e-4,
                                       atol=2 * optimizer.lr * STEPS, twin=twin)
    pytorch, float64 = twin.state_dict(), exact.state_dict()
    for name in [n for n in after if n in pytorch]:
        truth = float64[name].numpy()
        ours = np.linalg.norm(after[name].numpy() - truth)
        theirs = np.linalg.norm(pytorch[name].numpy() - truth)
        assert ours <= 2 * theirs + 1e-4 * np.linalg.norm(truth), (
            f"{name}: {ours:.3g} from the float64 step, PyTorch float32 {theirs:.3g}")
    names = signature["source_names"]
    trained = {names[p] for p in signature["trainable"]}
    assert [n for n in trained if not torch.equal(before[n], after[n])], "nothing updated"
