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


def compare(got: list, want: list, before: list, first_moments: list | None = None) -> dict:
    """The device's step outputs ``got`` against the host's ``want`` (the loss, then each
    updated tensor, whose value before the step is in ``before``; None for the loss).

    ``first_moments`` (``adam_first_moments``): Adam's first step moves each element by about
    its learning rate times the sign of its gradient, however small, so an element whose
    gradient is float noise moves either way on two CPUs (a key projection's bias: zero in
    exact arithmetic, softmax ignoring a constant shift; ~1e-11 against 1e-2 for a value
    bias). Such a tensor's update matches when its gradient does: its first moment within RTOL
    of the step's largest."""
    worst, worst_change, matches = 0.0, 0.0, len(got) == len(want)
    scale = max((float(np.max(np.abs(pair[1]))) for pair in first_moments or () if pair),
                default=0.0)
    by_gradient = 0
    for i, (g, w, b) in enumerate(zip(got, want, before)):
        elementwise = float(np.max(np.abs(g - w) / (ATOL + RTOL * np.abs(w))))
        worst = max(worst, elementwise)
        if elementwise <= 1.0:
            continue
        if b is None:  # the loss has no change to compare
            matches = False
            continue
        change = float(np.linalg.norm(g - w) / (np.linalg.norm(w - b) + ATOL * np.sqrt(w.size)))
        worst_change = max(worst_change, change)
        if change > CHANGE_RTOL and first_moments and first_moments[i] is not None:
            moment_got, moment_want = first_moments[i]
            if float(np.max(np.abs(moment_got - moment_want))) <= RTOL * scale:
                by_gradient += 1
                continue
        matches = matches and change <= CHANGE_RTOL
    # <= 1: every output within rtol 1e-4, atol 1e-5 of the host build's
    return {"matches_host": matches, "worst_diff_over_tolerance": worst,
            # of the outputs that are not: the worst's change off by this much of the host's
            "worst_change_error": worst_change,
            # updates off by more than that whose gradients agree (Adam at float noise)
            "matched_by_gradient": by_gradient}


def adam_first_moments(signature: dict, got: list, want: list) -> list:
    """For each output of a step with ``signature`` (``got`` and ``want`` two runs' outputs):
    the pair of its Adam first moments (``exp_avg``), or None (the loss, a moment, SGD)."""
    index = {name: i for i, name in enumerate(signature["outputs"])}
    moment = {f"new_{state['param']}": f"new_{name}"
              for name, state in signature.get("optimizer_state", {}).items()
              if state.get("torch") == "exp_avg"}
    return [(got[index[moment[n]]], want[index[moment[n]]])
            if moment.get(n) in index else None for n in signature["outputs"]]
