"""``experiment=llm``'s cases (docs/llm.md) at a reduced config, as CI can afford them: the
SmolLM-135M and Qwen2.5-0.5B architectures with 2 layers of their own widths (hidden size,
intermediate size, query and key-value heads), a 4096-token vocabulary and 32 tokens, seeded.
Every case of the experiment (full BP, the paper's transformer scheme, LoRA on q/v, Qwen2's
bias-only; AdamW) is built for the host and stepped 3 times beside PyTorch doing the same
update: the losses within 1e-4 relative, frozen weights bit-identical, the trained set
PyTorch's, and every trained tensor as close to PyTorch's in float64 as PyTorch's own float32
step is.

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
    models = ("smollm", "qwen", "qwen_512")
    return compose_params("experiment=llm", *[
        f"+models.{model}.config.{key}={value}" for model in models
        for key, value in REDUCED.items()], *[
        f"models.{model}.dims.sequence={SEQUENCE}" for model in models])


CASES = ["smollm_full", "smollm_paper", "smollm_lora", "qwen_full", "qwen_paper", "qwen_lora",
         "qwen_bias_only", "qwen_lora_512"]


def test_the_experiment_names_every_case_tested_here(llm):
    assert sorted(llm.cases) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_each_llm_case_steps_like_pytorch_in_place(llm, build_case, case):
    from pipelines.config import case_optimizer
    from pipelines.models.pytorch import make_optimizer, selection_of, train_step

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
