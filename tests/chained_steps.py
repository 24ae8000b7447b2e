"""Helpers for the text models' tests (test_transformer.py, test_minilm.py, test_lora.py): the
steps of a model built phase by phase through pipelines/compile.py, and a compiled step checked
against its PyTorch twin over chained steps with the tolerances those tests document (loss
within 1e-5 relative at every step, every tensor of the state within rtol 1e-4, atol 1e-6 at the
end, frozen parameters bit-identical)."""
from __future__ import annotations

from pathlib import Path

from conftest import assert_steps_match


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
    """conftest.assert_steps_match with these tests' tolerances (loss within 1e-5 relative,
    state within rtol 1e-4 / atol 1e-6), and the step holding every tensor of the twin's
    state. ``compiled`` needs ``directory``, ``initial`` and ``signature`` (a
    pipelines/compile.py Compiled, or a step built phase by phase)."""
    before, after = assert_steps_match(compiled, model, optimizer, batches, rtol=1e-4,
                                       atol=1e-6, loss_rtol=1e-5)
    assert set(after) == set(before)
    return before, after
