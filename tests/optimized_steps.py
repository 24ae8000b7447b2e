"""A case's step through the phases of pipelines/compile.py up to optimize (no build), for tests
that need the optimized module itself (its kernels, what it returns) and build it, if at all,
their own way. Each (configuration, case) once a session."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm

_CACHE: dict = {}


@dataclass(frozen=True)
class Optimized:
    model: object  # the pipelines/config.py Model
    full: tvm.IRModule  # every parameter updated (phase 2)
    pruned: tvm.IRModule  # the scheme's updates only (phase 3)
    optimized: tvm.IRModule  # phase 4, carrying its signature
    initial: dict[str, np.ndarray]  # by Relax name
    layers: dict


def optimized_case(params, case: str) -> Optimized:
    """The case's step as compile() makes it, from the source's seeded weights (as compile()
    without ``weights``), with the case's scheme, optimizer and optimize settings (a setting
    ``auto`` recomputes nothing: that is the device builds' choice)."""
    from pipelines.compile import optimize, sparse_update, training_graph
    from pipelines.config import case_optimize, case_optimizer
    from pipelines.frontends import import_model, lower_model
    from pipelines.frontends.weights import FILE, initial_weights, save_weights
    from pipelines.io import read_json
    from pipelines.training.scheme import select

    key = (id(params), case)
    if key in _CACHE:
        return _CACHE[key]
    spec = params.cases[case]
    model, scheme = params.models[spec.model], params.schemes[spec.scheme]
    if scheme.lora is not None:
        raise NotImplementedError("optimized_case: LoRA schemes go through compile()")
    settings = case_optimize(params, spec)
    with tempfile.TemporaryDirectory(prefix="pock-test-") as tmp:
        weights_dir, imported = Path(tmp) / "weights", Path(tmp) / "import"
        weights_dir.mkdir(), imported.mkdir()
        if model.in_pytorch:
            weights, _ = initial_weights(model.model_copy(update={"pretrain": None}), None, 0)
            save_weights(weights, weights_dir / FILE)
        import_model(model, weights_dir, imported)
        main, names, origins, values = lower_model(model, imported)
        layers = read_json(imported / "layers.json")
    full, _, _ = training_graph(main, names, origins, case_optimizer(params, spec))
    pruned = sparse_update(full, select(scheme.rules, layers), spec.scheme)
    optimized = optimize(pruned, reorder_updates=settings.reorder_updates,
                         recompute=settings.recompute == "always")
    _CACHE[key] = Optimized(model, full, pruned, optimized, values, layers)
    return _CACHE[key]
