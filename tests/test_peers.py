"""The peers that are not PyTorch (pipelines/peers): each trains the same model from the same
values on the same batch, and its first losses are checked against PyTorch doing the same
update before it is timed; one that disagrees or fails is reported so, not timed."""
import pytest
from conftest import random_batch

from pipelines.evaluate.speed import Spec, check_peers, time_interleaved
from pipelines.io import save_arrays

pytestmark = pytest.mark.slow
ORT = ["ort_training_full", "ort_training_frozen"]
pytest.importorskip("onnxruntime.training", reason="pip install -e '.[peers]'")


def spec_of(params, build_case, tmp_path_factory, case: str, model: str, optimizer: str):
    compiled = build_case(params, case)
    batch = tmp_path_factory.mktemp("peers") / "batch.npz"
    save_arrays(batch, dict(zip(compiled.signature["data"], random_batch(compiled, classes=2))))
    return Spec(cores=1, warmup=1, steps=2, batch=batch, build=compiled.directory,
                initial=compiled.initial, model=params.models[model],
                optimizer=params.optimizers[optimizer])


@pytest.mark.parametrize("case, model, optimizer", [("mbv2", "mbv2", "sgd"),
                                                    ("minilm_lora", "minilm", "adamw")])
def test_onnxruntime_training_agrees_with_pytorch_and_is_timed(
        small, build_case, tmp_path_factory, case, model, optimizer):
    spec = spec_of(small, build_case, tmp_path_factory, case, model, optimizer)
    losses, failed = check_peers(spec, ORT)
    assert failed == {}
    for peer in ORT:
        assert len(losses[peer]["peer"]) == 2
    results = time_interleaved(spec, ["compiled", *ORT])
    for peer in ORT:
        assert results[peer]["steps"] == 2 and results[peer]["median_ms"] > 0
