"""A compiled step checked against its PyTorch twin over chained steps with the tolerances the
text models' tests document (test_transformer.py, test_minilm.py, test_lora.py,
test_backends.py): loss within 1e-5 relative at every step, every tensor of the state within
rtol 1e-4, atol 1e-6 at the end, frozen parameters bit-identical."""
from __future__ import annotations

from conftest import assert_steps_match


def chained_steps_match(compiled, model, optimizer, batches) -> tuple[dict, dict]:
    """conftest.assert_steps_match with these tests' tolerances (loss within 1e-5 relative,
    state within rtol 1e-4 / atol 1e-6), and the step holding every tensor of the twin's
    state. ``compiled`` needs ``directory``, ``initial`` and ``signature`` (a
    pipelines/compile.py Compiled, or a step built phase by phase)."""
    before, after = assert_steps_match(compiled, model, optimizer, batches, rtol=1e-4,
                                       atol=1e-6, loss_rtol=1e-5)
    assert set(after) == set(before)
    return before, after
