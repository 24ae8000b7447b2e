"""Fine-tuning's learning rate (evaluate/finetune.py): the step takes it as state (its optimizer's
``lr`` slot, training/optimizers.py), so a schedule sets it each step without another build.

- the cosine schedule with warm-up is transformers' own (get_cosine_schedule_with_warmup);
- a run on it, compiled and PyTorch side by side: every step's loss within 1e-5 relative, the
  weights within rtol 1e-4 at the end; each step's learning rate recorded.
"""
import numpy as np
import pytest
import torch
from pydantic import TypeAdapter

from conftest import model_section
from pipelines.config import Optimizer
from pipelines.evaluate.finetune import finetune, learning_rate

ADAMW = TypeAdapter(Optimizer).validate_python({"kind": "adamw", "lr": 0.01,
                                                "weight_decay": 0.1})


def test_the_cosine_schedule_is_transformers_own():
    from transformers import get_cosine_schedule_with_warmup

    total, warmup = 40, 6
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    schedule = get_cosine_schedule_with_warmup(optimizer, warmup, total)
    theirs = []
    for _ in range(total):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    ours = [learning_rate(0.3, step, total, "cosine", warmup) for step in range(total)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert learning_rate(0.3, 17, total, "constant", warmup) == 0.3


def _classifier_data(seed: int) -> dict:
    """A seeded split for tests/frontends/task_heads.py's classifier: 40 training and 12 test
    examples of 5 features, 3 classes."""
    rng = np.random.default_rng(seed)
    return {f"finetune_{split}_{k}": v for split, n in (("train", 40), ("test", 12))
            for k, v in (("x", rng.standard_normal((n, 5)).astype("float32")),
                         ("y", rng.integers(0, 3, n)))}


def test_a_cosine_run_steps_like_pytorch(tmp_path, host_profile):
    from pipelines.compile import compile

    model = model_section(frontend="torch", source="tests/frontends/task_heads.py",
                          entry="classifier", batch_size=4,
                          finetune={"epochs": 2, "lr_schedule": "cosine", "warmup_steps": 3})
    compiled = compile(model, [{"modules": ["*"]}], ADAMW, host_profile, tmp_path)
    data = _classifier_data(0)
    run = finetune(model, compiled.directory, compiled.initial, ADAMW, data, 2, 0)
    assert [r["lr"] for r in run.losses] == [learning_rate(0.01, s, 20, "cosine", 3)
                                             for s in range(20)]
    for row in run.losses:
        assert row["compiled"] == pytest.approx(row["pytorch"], rel=1e-5), row
    # PyTorch's model after the same run: the fine-tuned weights match it
    from pipelines.frontends.twin import torch_twin
    from pipelines.models.pytorch import batches, make_optimizer, train_step

    twin = torch_twin(model, compiled.signature, compiled.initial)
    optimizer = make_optimizer(twin, ADAMW)
    step = 0
    for epoch in range(2):
        for index in batches(40, 4, 0, epoch):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(0.01, step, 20, "cosine", 3)
            train_step(twin, optimizer, data["finetune_train_x"][index],
                       data["finetune_train_y"][index])
            step += 1
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(run.weights[name].numpy(), value.detach().numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


def test_a_step_count_cuts_the_last_epoch_and_evaluations_come_every_n_steps(tmp_path,
                                                                              host_profile):
    from pipelines.compile import compile

    model = model_section(frontend="torch", source="tests/frontends/task_heads.py",
                          entry="classifier", batch_size=4,
                          finetune={"epochs": 1, "max_steps": 13, "eval_every": 5,
                                    "lr_schedule": "cosine"})
    compiled = compile(model, [{"modules": ["*"]}], ADAMW, host_profile, tmp_path)
    data = _classifier_data(1)
    run = finetune(model, compiled.directory, compiled.initial, ADAMW, data, 1, 0)
    # 10 steps an epoch: 13 steps are two epochs, the second cut after 3; the schedule spans 13
    assert (run.metrics["steps"], run.metrics["epochs"]) == (13, 2)
    assert [r["lr"] for r in run.losses] == [learning_rate(0.01, s, 13, "cosine", 0)
                                             for s in range(13)]
    assert [(e["epoch"], e["step"]) for e in run.evaluations] == [
        (0, 0), (0.5, 5), (1, 10), (1.3, 13)]


def test_several_runs_give_each_runs_scores_their_mean_and_spread(tmp_path, host_profile):
    from pipelines.compile import compile
    from pipelines.config import Benchmark
    from pipelines.evaluate.case import evaluate_case
    from pipelines.resolve import EvaluateInputs

    model = model_section(frontend="torch", source="tests/frontends/task_heads.py",
                          entry="classifier", batch_size=4, finetune={"epochs": 1, "runs": 3})
    compiled = compile(model, [{"modules": ["*"]}], ADAMW, host_profile, tmp_path / "build")
    inputs = EvaluateInputs(case="c", model_name="m", model=model, scheme="full",
                            optimizer_name="adamw", optimizer=ADAMW, lora=None,
                            evaluate=["finetune"], benchmark=Benchmark(
                                warmup=0, steps=1, rounds=1, min_seconds=0, peers=[]), seed=5)
    checkpoints = tmp_path / "checkpoints"
    result = evaluate_case(inputs, 1, compiled.directory, compiled.initial, _classifier_data(2),
                           compiled.report, compiled.plan, checkpoints)
    tuned = result.metrics["finetune"]
    runs = tuned["runs"]
    assert runs["seeds"] == [5, 6, 7]
    # the first run is the case's own; the others shuffle their batches differently
    assert runs["final_epoch_loss_compiled"][0] == tuned["final_epoch_loss_compiled"]
    assert len(set(runs["final_epoch_loss_compiled"])) == 3
    for key in ("accuracy_compiled", "accuracy_pytorch", "final_epoch_loss_pytorch"):
        assert runs[f"{key}_mean"] == pytest.approx(np.mean(runs[key]))
        assert runs[f"{key}_std"] == pytest.approx(np.std(runs[key]))
    # each run keeps its own checkpoint, so a killed evaluate@ goes on with the run it was in
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["run-2", "run-3"]
