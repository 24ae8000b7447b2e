"""The phases' results (pipelines/phases.py) save and load as they were: what a stage writes is
what the next one reads, a step's IR structurally equal, its arrays and tables equal. A small
classifier's chain, in memory (pipelines/compile.py), saved phase by phase."""
import numpy as np
import pytest
import torch
import tvm
from pydantic import TypeAdapter

from pipelines.compile import build, optimize, sparse_update, training_graph
from pipelines.config import Optimizer
from pipelines.frontends.layers import describe_layers
from pipelines.frontends.torch_program import translate
from pipelines.phases import (Build, Lowered, OptimizedStep, PrunedStep, Reference, TrainingStep,
                              Tuning)

SGD = TypeAdapter(Optimizer).validate_python({"kind": "sgd", "lr": 0.1, "momentum": 0.9})


@pytest.fixture(scope="module")
def lowered():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    main, names, origins = translate(torch.export.export(model, (torch.zeros(4, 6),)))
    values = {r: model.state_dict()[s].numpy() for r, (_, s) in names.items()}
    return Lowered(main, names, origins, values, describe_layers(model))


def same_arrays(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_every_phase_saves_and_loads_as_it_was(lowered, tmp_path, host_profile):
    back = Lowered.load(_saved(lowered, tmp_path / "lower"))
    tvm.ir.assert_structural_equal(back.main, lowered.main)
    assert back.names == lowered.names and back.origins == lowered.origins
    assert same_arrays(back.values, lowered.values) and back.layers == lowered.layers

    full = training_graph(lowered, SGD)
    back = TrainingStep.load(_saved(full, tmp_path / "autodiff"))
    tvm.ir.assert_structural_equal(back.module, full.module)
    assert back.signature == full.signature and back.layers == full.layers
    assert same_arrays(back.initial, full.initial)
    assert same_arrays(TrainingStep.load_initial(tmp_path / "autodiff"), full.initial)

    pruned = sparse_update(full, [{"modules": ["2"]}], "head")
    back = PrunedStep.load(_saved(pruned, tmp_path / "prune"))
    tvm.ir.assert_structural_equal(back.module, pruned.module)
    assert back.rules == pruned.rules

    optimized = optimize(pruned, recompute="auto", budgets={"tiny": 1})  # over: a twin too
    back = OptimizedStep.load(_saved(optimized, tmp_path / "optimize"))
    tvm.ir.assert_structural_equal(back.module, optimized.module)
    tvm.ir.assert_structural_equal(back.recompute, optimized.recompute)
    assert back.plan == optimized.plan and optimized.plan["recompute"]["for"] == ["tiny"]
    for variant in ("step", "recompute"):
        module, plan = OptimizedStep.load_variant(tmp_path / "optimize", variant)
        tvm.ir.assert_structural_equal(module, optimized.variant(variant)[0])
        assert plan == optimized.variant(variant)[1]

    (tmp_path / "tune").mkdir()
    Tuning(tmp_path / "tune", "recompute", {"kernels": 3}).save()
    assert Tuning.load(tmp_path / "tune") == Tuning(tmp_path / "tune", "recompute",
                                                    {"kernels": 3})

    (tmp_path / "build").mkdir()
    built = build(optimized.module, optimized.plan, host_profile, tmp_path / "build")
    assert Build.load(tmp_path / "build") == built
    assert built.library.exists()

    outputs = {name: np.full((2,), i, "float32") for i, name in
               enumerate(reversed(built.signature["outputs"]))}
    Reference(outputs).save(tmp_path / "reference")
    ordered = Reference.load(tmp_path / "reference").ordered(built.signature)
    assert [a[0] for a in ordered] == [outputs[n][0] for n in built.signature["outputs"]]


def _saved(result, directory):
    directory.mkdir()
    result.save(directory)
    return directory
