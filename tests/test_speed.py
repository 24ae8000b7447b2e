"""evaluate/speed.py's timing discipline: the compiled step and its peers, each in its own
process, timed in interleaved rounds; peers that do not fit beside each other (the machine's
available memory against the largest case measured so far) take their turn in later groups
against the compiled step, so every peer is measured and none is dropped."""
import numpy as np
import pytest
from conftest import random_batch

from pipelines.evaluate.speed import Spec, time_interleaved
from pipelines.io import save_arrays

pytestmark = pytest.mark.slow
CASES = ["compiled", "torch_eager_full", "torch_eager_frozen"]


@pytest.fixture(scope="module")
def spec(small, build_case, tmp_path_factory):
    compiled = build_case(small, "llama_paper")
    batch = tmp_path_factory.mktemp("speed") / "batch.npz"
    save_arrays(batch, dict(zip(compiled.signature["data"], random_batch(compiled))))
    return Spec(cores=1, warmup=1, steps=2, batch=batch, build=compiled.directory,
                initial=compiled.initial, model=small.models["llama_tiny"],
                optimizer=small.optimizers["sgd"])


@pytest.mark.parametrize("room, groups", [(2**50, 1), (0, 2)])
def test_every_peer_is_timed_against_the_compiled_step(spec, room, groups):
    results = time_interleaved(spec, CASES, available=lambda: room)
    # the compiled step is timed in every group; each peer in its own
    assert results["compiled"]["steps"] == 2 * groups
    for case in CASES:
        assert results[case]["median_ms"] > 0 and results[case]["peak_rss_bytes"] > 0
        assert np.isfinite(results[case]["p90_ms"])
        # the time to a first step: its setup (loading the library, building the model), then
        # the first step, each measured, not a step's median
        assert 0 < results[case]["setup_s"] < 60 and results[case]["first_step_ms"] > 0
    assert results["torch_eager_full"]["steps"] == results["torch_eager_frozen"]["steps"] == 2
