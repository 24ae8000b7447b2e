"""Helpers for the text models' tests (test_transformer.py, test_minilm.py, test_lora.py): the
steps of a model built phase by phase through pipelines/compile.py, and a compiled step checked
against its PyTorch twin over chained steps with the tolerances those tests document (loss
within 1e-5 relative at every step, every tensor of the state within rtol 1e-4, atol 1e-6 at the
end, frozen parameters bit-identical)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import twin_of


def lowered(model, directory: Path, seed: int = 0):
    """A torch model's weights (seeded, as compile takes them), import and lower phases:
    (main, names, origins, initial values by Relax name, layers)."""
    from pipelines.frontends import import_model, lower_model
    from pipelines.frontends.weights import FILE, initial_weights, save_weights
    from pipelines.io import read_json

    weights, imported = Path(directory) / "weights", Path(directory) / "import"
    weights.mkdir(parents=True), imported.mkdir()
    state, _ = initial_weights(model.model_copy(update={"pretrain": None}), None, seed)
    save_weights(state, weights / FILE)
    import_model(model, weights, imported)
    main, names, origins, values = lower_model(model, imported)
    return main, names, origins, values, read_json(imported / "layers.json")


def chained_steps_match(compiled, model, optimizer, batches) -> tuple[dict, dict]:
    """Run ``compiled`` (a pipelines/compile.py Compiled) and PyTorch's step on its twin from
    the same state for each batch: losses within 1e-5 relative, the final state within rtol
    1e-4 / atol 1e-6, parameters outside the scheme bit-identical. Returns the state before and
    after, by the source's names."""
    from pipelines.models.torch_twin import make_optimizer, train_step
    from pipelines.runtime.step import CompiledStep, selection_of

    twin = twin_of(compiled, model)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    step = CompiledStep(compiled.directory, compiled.initial)
    selection = selection_of(compiled.signature)
    update = make_optimizer(twin, optimizer, selection)
    for batch in batches:
        want = train_step(twin, update, *batch)
        assert step.step(*batch) == pytest.approx(want, rel=1e-5)
    after = step.state_dict()
    assert set(after) == set(twin.state_dict())
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(after[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
        if name not in selection:
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy(),
                                          err_msg=f"{name} is frozen")
    return before, {k: torch.clone(v) for k, v in after.items()}
