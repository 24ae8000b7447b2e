"""Whether two runs of a step agree: a device's build against the host's, the native runner
against the Python one. Different CPUs and vector widths sum in different orders, so builds
for two CPUs agree to a tolerance, not bit for bit."""
from __future__ import annotations

import numpy as np

# A device's step must match the host build's: each output elementwise to RTOL/ATOL (different
# CPUs and vector widths sum in different orders); or, for an updated tensor, its change to
# CHANGE_RTOL of the host's (L2 norms). The second is for ReLU6 networks: where an activation
# lands within an ulp of 0 or 6, the two builds can fall on opposite sides and pass or block
# that element's gradient (MobileNetV2: a pointwise conv's gradient 3% apart); a wrong update is
# off by ~100% of its change. The tests hold PyTorch to the same (conftest.assert_steps_match).
RTOL, ATOL = 1e-4, 1e-5
CHANGE_RTOL = 0.05


def compare(got: list, want: list, before: list) -> dict:
    """The device's step outputs ``got`` against the host's ``want`` (the loss, then each
    updated tensor, whose value before the step is in ``before``; None for the loss)."""
    worst, worst_change, matches = 0.0, 0.0, len(got) == len(want)
    for g, w, b in zip(got, want, before):
        elementwise = float(np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w))))
        worst = max(worst, elementwise)
        if elementwise <= 1.0:
            continue
        if b is None:  # the loss has no change to compare
            matches = False
            continue
        change = float(np.linalg.norm(g - w) / (np.linalg.norm(w - b) + ATOL * np.sqrt(w.size)))
        worst_change = max(worst_change, change)
        matches = matches and change <= CHANGE_RTOL
    # <= 1: every output within rtol 1e-4, atol 1e-5 of the host build's
    return {"matches_host": matches, "worst_diff_over_tolerance": worst,
            # of the outputs that are not: the worst's change off by this much of the host's
            "worst_change_error": worst_change}
