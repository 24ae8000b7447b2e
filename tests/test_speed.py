"""evaluate/speed.py's timing discipline: the compiled step and its peers, each in its own
process, timed in interleaved rounds; peers that do not fit beside each other (the machine's
available memory against the largest process measured so far) take their turn in later groups
against the compiled step, or, where one fits beside nothing, take turns with it one process at a
time, so every peer is measured and none is dropped."""
import multiprocessing

import numpy as np
import pytest
from conftest import random_batch

from pipelines.evaluate import speed
from pipelines.evaluate.speed import Spec, time_interleaved
from pipelines.io import save_arrays

pytestmark = pytest.mark.slow
CASES = ["compiled", "torch_eager_full", "torch_eager_frozen"]


@pytest.fixture(scope="module")
def spec(small, build_case, tmp_path_factory):
    compiled = build_case(small, "llama_paper")
    batch = tmp_path_factory.mktemp("speed") / "batch.npz"
    save_arrays(batch, dict(zip(compiled.signature["data"], random_batch(compiled))))
    return Spec(cores=1, warmup=1, steps=2, rounds=2, batch=batch, build=compiled.directory,
                initial=compiled.initial, model=small.models["llama_tiny"],
                optimizer=small.optimizers["sgd"])


def room_beside_one() -> int:
    """Room for one more process while one case's is up, none beside two."""
    return 2**50 if len(multiprocessing.active_children()) <= 1 else 0


@pytest.mark.parametrize(
    "available, most_beside, compiled_steps, compiled_processes, peer_processes", [
        (lambda: 2**50, 2, 2, 1, 1),  # every case beside the others: one group
        (room_beside_one, 1, 4, 1, 1),  # each peer beside the compiled step in its own group
        # none beside another: a fresh process of each in turn, one up at a time (the compiled
        # step's last one timed against the next peer too)
        (lambda: 0, 0, 4, 3, 2)])
def test_every_peer_is_timed_against_the_compiled_step(spec, monkeypatch, available, most_beside,
                                                       compiled_steps, compiled_processes,
                                                       peer_processes):
    beside = []  # how many case processes were up as each started

    class Counted(speed._Case):
        def __init__(self, *args):
            beside.append(len(multiprocessing.active_children()))
            super().__init__(*args)

    monkeypatch.setattr(speed, "_Case", Counted)
    results = time_interleaved(spec, CASES, available=available)
    assert max(beside) == most_beside
    assert results["compiled"]["steps"] == compiled_steps
    assert results["compiled"]["processes"] == compiled_processes
    for case in CASES:
        assert results[case]["median_ms"] > 0 and results[case]["peak_rss_bytes"] > 0
        assert np.isfinite(results[case]["p90_ms"])
        # the time to a first step: its setup (loading the library, building the model), then
        # the first step, each measured, not a step's median
        assert 0 < results[case]["setup_s"] < 60 and results[case]["first_step_ms"] > 0
    for peer in CASES[1:]:
        assert results[peer]["steps"] == 2 and results[peer]["processes"] == peer_processes
    assert not multiprocessing.active_children()  # every case's process is gone
