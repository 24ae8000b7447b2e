"""The one compile chain: a model, a scheme, an optimizer and a device profile in; a built training
step out. Each phase is one function here, in order, taking the previous phase's result
(pipelines/phases.py) and returning its own; each DVC stage runs one of them (load -> phase ->
save), and ``compile`` runs them all in memory, for tests and tools. No other module puts passes
in order.

    Phase 1  import + lower  frontends: the model's source -> Lowered, main(*inputs, *params,
                             *buffers)
    Phase 2  training graph  take indices flattened, LoRA adapters, loss + gradient + optimizer
                             -> TrainingStep
    Phase 3  sparse update   frozen parameters' updates pruned, channel-sparse updates sliced
                             -> PrunedStep
    Phase 4  optimize        updates reordered, activations recomputed, the loss and products as
                             kernels of their own, frozen batch norms as arithmetic, then
                             legalized and fused, the state updated in place; the static
                             memory plan (Phase 5, read without building)
                             -> OptimizedStep
    Phase 6  build           tuned or default schedules, backend choice, codegen, link
                             (backend/) -> Build
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from pipelines.analysis.cost import scheme_report
from pipelines.analysis.liveness import update_kernels
from pipelines.analysis.memory_plan import memory_plan
from pipelines.backend.build import PLANNED, build_step
from pipelines.frontends import import_model, lower_model
from pipelines.frontends.weights import FILE as WEIGHTS, save_weights
from pipelines.ir import FIXED_PARAMETERS, signature_of, with_signature, without_signature
from pipelines.phases import Build, Lowered, OptimizedStep, PrunedStep, TrainingStep
from pipelines.profiles import variant_for
from pipelines.stored_weights import STORED_AS
from pipelines.training.graph import build_train_step, unreached_parameters
from pipelines.training.lora import adapter_layers, add_adapters
from pipelines.training.optimizers import from_config
from pipelines.training.scheme import lr_scales, select
from pipelines.transform import (BoolOpsAsInts, ChunkLossRows, CollapseReshapes,
                                 FlattenTakeIndices, FoldConstantReshapes, FreezeStatistics,
                                 FrozenNormsElementwise, FuseSoftmaxCrossEntropy, IsolateGemms,
                                 LossGradientInPlace, MaxPoolGradInBounds, NonFiniteFills,
                                 PlainPowers, PruneFrozenUpdates, RecomputeActivations,
                                 ReorderUpdates, SliceChannelUpdates, SplitAsSlices,
                                 StoreFrozenWeights, UpdateInPlace)
from pipelines.transform.freeze_statistics import norm_scales
from pipelines.transform.store_frozen_weights import largest_stored

NOTHING = tvm.transform.Sequential([])  # an optional pass that is off keeps its place

# Phase 5: the CPU build's own passes up to memory planning, to read the plan.
PLAN = tvm.transform.Sequential(PLANNED)


def lower(model, imported: Path) -> Lowered:
    """Phase 1: the model imported into ``imported`` (frontends: ``import_model``) as Relax."""
    return lower_model(model, imported)


def training_graph(lowered: Lowered, optimizer, lora=None, seed: int = 0,
                   task: str = "classification", rules: list | None = None,
                   statistics: str = "trained_layers") -> TrainingStep:
    """Phase 2: the full training step (every parameter updated) with the ``task``'s loss
    (training/loss.py) and ``optimizer``'s update (a pipelines/config.py optimizer section);
    with ``lora`` (a scheme's LoRA section), its adapters beside the layers it names
    (training/lora.py), seeded. With ``rules`` (all a scheme may select), what a rule with an
    ``lr_scale`` selects is updated at the learning rate times it, and with ``statistics``
    ``trained_layers`` a batch norm whose scale they leave frozen keeps its running statistics
    and normalises with them (transform/freeze_statistics.py)."""
    main = tvm.transform.Sequential([FlattenTakeIndices(), BoolOpsAsInts(), SplitAsSlices(),
                                     NonFiniteFills()])(
        tvm.IRModule({"main": lowered.main}))["main"]
    count, names = int(main.attrs["num_input"]), lowered.names
    num_params = sum(1 for v in main.params[count:] if names[v.name][0] == "parameter")
    adapters, values = {}, {}
    if lora is not None:
        main, adapters, values = add_adapters(main, names, num_params, lora, seed)
        num_params += len(adapters)
    names = {**names, **adapters}
    layers = adapter_layers(lowered.layers, adapters, values) if adapters else lowered.layers
    frozen = ([] if rules is None or statistics != "trained_layers"
              else frozen_norms(main, names, select(rules, layers)))
    main = FreezeStatistics(frozen)(tvm.IRModule({"main": main}))["main"]
    scales = {} if rules is None else lr_scales(rules, layers)
    source_names = {v.name: names[v.name][1] for v in main.params[count:]}
    step, signature = build_train_step(main, num_params, from_config(optimizer),
                                       lowered.origins, task,
                                       {r: scales[s] for r, s in source_names.items()
                                        if s in scales})
    signature["source_names"] = source_names
    signature["num_params"] = num_params
    # no scheme trains these: as in PyTorch, where they get no gradient (an unused pooler)
    signature["unreached"] = [names[v.name][1] for v in
                              unreached_parameters(main, main.params[count:count + num_params])]
    # nor these, which the source framework holds fixed (requires_grad=False)
    signature["fixed"] = [names[str(v)][1] for v in (main.attrs or {}).get(FIXED_PARAMETERS, [])]
    # the layers whose statistics stay frozen, for the PyTorch twin to hold in eval mode
    signature["frozen_statistics"] = [names[scale][1].rsplit(".", 1)[0] for scale in frozen]
    if scales:  # for the PyTorch twin's param groups (models/pytorch.py: make_optimizer)
        signature["lr_scales"] = scales
    if lora is not None:  # for the PyTorch twin's adapters (models/torch_lora.py)
        signature["lora"] = {"rank": lora.rank, "scale": lora.scale}
    return TrainingStep(with_signature(tvm.IRModule({"train_step": step}), signature),
                        {**lowered.values, **values}, layers)


def frozen_norms(main: relax.Function, names: dict, selection: dict) -> list[str]:
    """The scales (Relax names) of ``main``'s batch norms whose scale ``selection`` (source
    names) leaves frozen."""
    return sorted(scale for scale in norm_scales(main)
                  if scale in names and names[scale][1] not in selection)


def prune(full: tvm.IRModule, selection: dict, scheme_name: str) -> tvm.IRModule:
    """The full step restricted to a scheme's ``selection`` (training/scheme.py: the model's
    parameter name -> None, or the channels to update)."""
    signature = signature_of(full)
    relax_of = {source: name for name, source in signature["source_names"].items()}
    pruned = tvm.transform.Sequential([
        PruneFrozenUpdates({relax_of[n] for n in selection}),
        SliceChannelUpdates({relax_of[n]: s for n, s in selection.items() if s is not None}),
    ])(full)
    return with_signature(pruned, dict(signature_of(pruned), scheme=scheme_name))


def sparse_update(full: TrainingStep, rules: list, scheme_name: str) -> PrunedStep:
    """Phase 3: the full step with only what the scheme's ``rules`` select updated, and what
    that removes from full backpropagation (analysis/cost.py)."""
    rules = [r if isinstance(r, dict) else r.model_dump(exclude_none=True) for r in rules]
    signature = signature_of(full.module)
    untrainable = {*signature.get("unreached", []), *signature.get("fixed", [])}
    selection = {k: v for k, v in select(rules, full.layers).items() if k not in untrainable}
    pruned = prune(full.module, selection, scheme_name)
    return PrunedStep(pruned, rules, scheme_report(full.module, pruned))


def _optimized(pruned: tvm.IRModule, reorder_updates: bool, recompute: bool,
               update_in_place: bool, loss_chunk_rows: int, frozen_dtype: str,
               kept_float32=()) -> tvm.IRModule:
    return tvm.transform.Sequential([
        ReorderUpdates() if reorder_updates else NOTHING,
        RecomputeActivations() if recompute else NOTHING,
        FuseSoftmaxCrossEntropy(),
        ChunkLossRows(loss_chunk_rows),  # a frozen LM head's logits: one chunk of rows at a time
        IsolateGemms(),
        StoreFrozenWeights(frozen_dtype, kept_float32),  # widened at each reader
        FoldConstantReshapes(),
        relax.transform.FoldConstant(),  # the gradient's exponent 2 - 1 becomes a constant
        PlainPowers(),
        FrozenNormsElementwise(),  # a frozen batch norm fuses into its convolution's kernel
        MaxPoolGradInBounds(),  # TVM's legalization of it reads out of bounds
        CollapseReshapes(),  # the LM head's rows reshaped and back were a copy of the logits
        # fusion works on legalized TIR: elementwise and broadcast work (the optimizer's update,
        # batch norm arithmetic, ReLU6 masks) folds into the kernel that produces its input
        relax.transform.CanonicalizeBindings(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["train_step"]),
        UpdateInPlace() if update_in_place else NOTHING,
        LossGradientInPlace(),
    ])(pruned)


def plan(optimized: tvm.IRModule) -> dict:
    """Phase 5: the optimized step's planned peak memory and its breakdown."""
    return memory_plan(optimized, PLAN(without_signature(optimized)), signature_of(optimized))


def optimize(pruned: PrunedStep, reorder_updates: bool = True, recompute: str = "never",
             budgets: dict[str, float] | None = None, update_in_place: bool = True,
             loss_chunk_rows: int = 0, frozen_dtype: str = "float32") -> OptimizedStep:
    """Phase 4 (and 5): the pruned step optimized and fused (target-independent), and its plan.
    ``recompute``: never, always, or auto: the step keeps its activations, and a twin that
    recomputes cheap ones is made too when the plan is over one of ``budgets`` (bytes, by
    device: the devices that build the case). ``update_in_place``: the state's new values
    written over the old ones (transform/update_in_place.py). ``loss_chunk_rows``: a frozen LM
    head's logits and loss taken that many rows at a time (transform/chunk_loss_rows.py; 0:
    all at once). ``frozen_dtype``: what the weights no update writes are stored as
    (transform/store_frozen_weights.py)."""
    options = (update_in_place, loss_chunk_rows, frozen_dtype)
    step = _optimized(pruned.module, reorder_updates, recompute == "always", *options)
    planned, kept = plan(step), ()
    largest = largest_stored(step)
    if largest is not None:  # a product's float32 copy of it may cost more than it saves
        other = _optimized(pruned.module, reorder_updates, recompute == "always", *options,
                           {largest})
        other_plan = plan(other)
        if other_plan["planned_peak_bytes"] < planned["planned_peak_bytes"]:
            step, planned, kept = other, other_plan, (largest,)
    signature = signature_of(step)
    stored = {"frozen_dtype": frozen_dtype, "stored_narrower": len(signature.get(STORED_AS, {})),
              "kept_float32": list(kept)}
    planned |= {"reorder_updates": reorder_updates,
                "updated_in_place": len(signature.get("updated_in_place", [])), **stored,
                "recomputed": recompute == "always", "recompute": None}
    twin = None
    over = [d for d, b in (budgets or {}).items() if planned["planned_peak_bytes"] > b]
    if recompute == "auto" and over:
        twin = _optimized(pruned.module, reorder_updates, True, *options, kept)
        planned["recompute"] = plan(twin) | stored | {"recomputed": True, "for": sorted(over)}
    return OptimizedStep(step, planned, twin)


def build(optimized: tvm.IRModule, plan: dict, profile, directory: Path,
          database=None) -> Build:
    """Phase 6: ``optimized`` (the variant the profile takes, with its ``plan``) built for
    ``profile`` into ``directory``, its signature and plan beside it."""
    signature = signature_of(optimized)
    built = build_step(without_signature(optimized), profile, directory, database,
                       inputs=len(signature["data"]))
    built["update_kernels"] = update_kernels(optimized)  # for the kernel profile's phases
    built = Build(Path(directory), signature, plan, built)
    built.save()
    return built


@dataclass
class Compiled:
    """A step ``compile`` built, and every phase's result on the way."""

    full: TrainingStep
    pruned: PrunedStep
    optimized: OptimizedStep
    build: Build

    @property
    def directory(self) -> Path:
        return self.build.directory

    @property
    def signature(self) -> dict:
        return self.build.signature

    @property
    def initial(self) -> dict[str, np.ndarray]:
        """The initial value of every parameter and buffer (by Relax name)."""
        return self.full.initial

    @property
    def layers(self) -> dict:
        return self.full.layers

    @property
    def report(self) -> dict:
        """What the scheme removes from full BP."""
        return self.pruned.report

    @property
    def plan(self) -> dict:
        """The planned memory of the step built."""
        return self.build.plan

    @property
    def built(self) -> dict:
        """What the build did (backend/build.py)."""
        return self.build.built


def import_and_lower(model, weights: dict | None = None, seed: int = 0) -> Lowered:
    """Phase 1 in memory: ``model`` (a pipelines/config.py model section) from its source,
    with ``weights`` (a state dict, for a torch model; default: the source's own, seeded)."""
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
        return lower(model, imported)


def compile_to_plan(model, rules: list, optimizer, *, lora=None, weights: dict | None = None,
                    seed: int = 0, reorder_updates: bool = True, recompute: str = "never",
                    budgets: dict[str, float] | None = None, scheme_name: str = "scheme",
                    lowered: Lowered | None = None, update_in_place: bool = True,
                    loss_chunk_rows: int = 0, statistics: str = "trained_layers",
                    frozen_dtype: str = "float32"
                    ) -> tuple[TrainingStep, PrunedStep, OptimizedStep]:
    """Phases 1 to 5 in memory: ``model`` (from ``lowered`` if given, else imported with
    ``weights``), the scheme's ``rules`` (and ``lora``, and its batch norms' ``statistics``),
    ``optimizer``; ``budgets`` by device, for ``recompute`` auto. What the DVC chain does up to
    optimize@, without its files."""
    lowered = lowered or import_and_lower(model, weights, seed)
    full = training_graph(lowered, optimizer, lora, seed, model.task, rules, statistics)
    pruned = sparse_update(full, rules, scheme_name)
    return full, pruned, optimize(pruned, reorder_updates, recompute, budgets, update_in_place,
                                  loss_chunk_rows, frozen_dtype)


def compile(model, rules: list, optimizer, profile, directory: Path, *, database=None,
            **options) -> Compiled:
    """Every phase in memory: ``compile_to_plan`` (``options`` are its keywords), then the
    variant that fits ``profile``'s budget built for it into ``directory``."""
    full, pruned, optimized = compile_to_plan(model, rules, optimizer,
                                              budgets={profile.name: profile.budget_bytes},
                                              **options)
    step, planned = optimized.variant(variant_for(optimized.plan, profile))
    Path(directory).mkdir(parents=True, exist_ok=True)
    return Compiled(full, pruned, optimized, build(step, planned, profile, directory, database))
