"""The one compile chain: a model, a scheme, an optimizer and a device profile in; a built training
step out. Each phase is one function here, in order, and each DVC stage runs one of them
(stages/<phase>.py writes its result to disk); ``compile`` runs them all in memory, for tests
and tools. No other module puts passes in order.

    Phase 1  import         frontends: the model's source -> Relax main(*inputs, *params, *buffers)
    Phase 2  training graph take indices flattened, LoRA adapters, loss + gradient + optimizer
    Phase 3  sparse update  frozen parameters' updates pruned, channel-sparse updates sliced
    Phase 4  optimize       updates reordered, activations recomputed, the loss and products as
                            kernels of their own, then legalized and fused
    Phase 5  memory plan    TVM's static plan, read without building
    Phase 6  build          tuned or default schedules, backend choice, codegen, link (backend/)
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from pipelines.analysis.cost import scheme_report
from pipelines.analysis.memory_plan import memory_plan
from pipelines.backend.build import build_step
from pipelines.frontends import import_model, lower_model
from pipelines.frontends.weights import FILE as WEIGHTS, save_weights
from pipelines.io import read_json, write_json_atomic
from pipelines.ir import signature_of, with_signature, without_signature
from pipelines.profiles import check_memory_budget
from pipelines.runtime.step import SIGNATURE
from pipelines.training.graph import build_train_step
from pipelines.training.lora import adapter_layers, add_adapters
from pipelines.training.optimizers import from_config
from pipelines.training.scheme import select
from pipelines.transform import (BoolOpsAsInts, FlattenTakeIndices, FuseSoftmaxCrossEntropy, IsolateGemms,
                                 PlainPowers, PruneFrozenUpdates, RecomputeActivations,
                                 ReorderUpdates, SliceChannelUpdates)

NOTHING = tvm.transform.Sequential([])  # an optional pass that is off keeps its place

# Phase 5: the build's own first passes up to static memory planning, to read the plan.
PLAN = tvm.transform.Sequential([
    relax.transform.RewriteDataflowReshape(),
    relax.transform.ToNonDataflow(),
    relax.transform.RemovePurityChecking(),
    relax.transform.CallTIRRewrite(),
    relax.transform.StaticPlanBlockMemory(),
])


def training_graph(main: relax.Function, names: dict, origins: dict, optimizer, lora=None,
                   seed: int = 0, task: str = "classification") -> tuple[tvm.IRModule, dict, dict]:
    """Phase 2: the lowered ``main`` -> the full training step (every parameter updated) with
    the ``task``'s loss (training/loss.py), as a module carrying its signature; and the LoRA
    adapters' names and initial values, if the scheme has ``lora`` (training/lora.py)."""
    main = tvm.transform.Sequential([FlattenTakeIndices(), BoolOpsAsInts()])(
        tvm.IRModule({"main": main}))["main"]
    count = int(main.attrs["num_input"])
    num_params = sum(1 for v in main.params[count:] if names[v.name][0] == "parameter")
    adapters, values = {}, {}
    if lora is not None:
        main, adapters, values = add_adapters(main, names, num_params, lora, seed)
        num_params += len(adapters)
    names = {**names, **adapters}
    step, signature = build_train_step(main, num_params, from_config(optimizer), origins, task)
    signature["source_names"] = {v.name: names[v.name][1] for v in main.params[count:]}
    signature["num_params"] = num_params
    if lora is not None:  # for the PyTorch twin's adapters (models/lora.py)
        signature["lora"] = {"rank": lora.rank, "scale": lora.scale}
    return with_signature(tvm.IRModule({"train_step": step}), signature), adapters, values


def case_layers(layers: dict, adapters: dict, values: dict) -> dict:
    """layers.json of a case: the model's, with its LoRA adapters, if any."""
    return adapter_layers(layers, adapters, values) if adapters else layers


def sparse_update(full: tvm.IRModule, selection: dict, scheme_name: str) -> tvm.IRModule:
    """Phase 3: the full step restricted to a scheme's ``selection`` (training/scheme.py: the
    model's parameter name -> None, or the channels to update)."""
    signature = signature_of(full)
    relax_of = {source: name for name, source in signature["source_names"].items()}
    pruned = tvm.transform.Sequential([
        PruneFrozenUpdates({relax_of[n] for n in selection}),
        SliceChannelUpdates({relax_of[n]: s for n, s in selection.items() if s is not None}),
    ])(full)
    return with_signature(pruned, dict(signature_of(pruned), scheme=scheme_name))


def optimize(pruned: tvm.IRModule, reorder_updates: bool, recompute: bool) -> tvm.IRModule:
    """Phase 4: the pruned step optimized and fused (target-independent)."""
    return tvm.transform.Sequential([
        ReorderUpdates() if reorder_updates else NOTHING,
        RecomputeActivations() if recompute else NOTHING,
        FuseSoftmaxCrossEntropy(),
        IsolateGemms(),
        relax.transform.FoldConstant(),  # the gradient's exponent 2 - 1 becomes a constant
        PlainPowers(),
        # fusion works on legalized TIR: elementwise and broadcast work (the optimizer's update,
        # batch norm arithmetic, ReLU6 masks) folds into the kernel that produces its input
        relax.transform.CanonicalizeBindings(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["train_step"]),
    ])(pruned)


def plan(optimized: tvm.IRModule) -> dict:
    """Phase 5: the optimized step's planned peak memory and its breakdown."""
    return memory_plan(optimized, PLAN(without_signature(optimized)), signature_of(optimized))


def optimized_for(profile: dict, directory: Path) -> tuple[Path, dict]:
    """The optimize stage's step a device builds (in ``directory``), and its plan: the
    recomputing twin where only it fits the profile's memory budget; over budget either way,
    a ConfigError naming the overshoot and the knobs."""
    planned = read_json(Path(directory) / "plan.json")
    if check_memory_budget(planned, profile, Path(directory) / "plan.json"):
        return Path(directory) / "train_step_recompute.json", planned["recompute"]
    return Path(directory) / "train_step.json", planned


def build(optimized: tvm.IRModule, profile: dict, directory: Path, database=None) -> dict:
    """Phase 6: the step built for ``profile`` into ``directory``, its signature beside it;
    what the manifest records (backend/build.py)."""
    built = build_step(without_signature(optimized), profile, directory, database)
    write_json_atomic(Path(directory) / SIGNATURE, signature_of(optimized))
    return built


@dataclass
class Compiled:
    """A step ``compile`` built: where, its signature, the initial value of every parameter and
    buffer (by Relax name), and what the scheme, the plan and the build say."""

    directory: Path
    signature: dict
    initial: dict[str, np.ndarray]
    layers: dict
    report: dict
    plan: dict
    built: dict


def compile(model, rules: list, optimizer, profile: dict, directory: Path, *, lora=None,
            weights: dict | None = None, seed: int = 0, reorder_updates: bool = True,
            recompute: bool = False, database=None, scheme_name: str = "scheme") -> Compiled:
    """Every phase in memory: ``model`` (a pipelines/config.py Model) with ``weights`` (a state
    dict, for a torch model; default: the source's own), the scheme's ``rules`` (and ``lora``),
    ``optimizer``, built for ``profile`` into ``directory``. What the DVC chain does stage by
    stage, without its files."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="pock-compile-") as tmp:
        imported, weights_dir = Path(tmp) / "import", Path(tmp) / "weights"
        imported.mkdir(), weights_dir.mkdir()
        if model.in_pytorch:
            if weights is None:
                from pipelines.frontends.weights import initial_weights

                weights, _ = initial_weights(model.model_copy(update={"pretrain": None}), None,
                                             seed)
            save_weights(weights, weights_dir / WEIGHTS)
        import_model(model, weights_dir, imported)
        main, names, origins, values = lower_model(model, imported)
        layers = read_json(imported / "layers.json")
    full, adapters, adapter_values = training_graph(main, names, origins, optimizer, lora, seed,
                                                    model.task)
    layers = case_layers(layers, adapters, adapter_values)
    pruned = sparse_update(full, select(rules, layers), scheme_name)
    optimized = optimize(pruned, reorder_updates, recompute)
    directory.mkdir(parents=True, exist_ok=True)
    built = build(optimized, profile, directory, database)
    return Compiled(directory, signature_of(optimized), {**values, **adapter_values}, layers,
                    scheme_report(full, pruned), plan(optimized), built)
