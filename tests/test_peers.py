"""The peers that are not PyTorch (pipelines/peers): each trains the same model from the same
values on the same batch, and its first losses are checked against PyTorch doing the same
update before it is timed; one that disagrees or fails is reported so, not timed."""
import importlib.util

import pytest
from conftest import random_batch

from pipelines.evaluate.speed import Spec, check_peers, time_interleaved
from pipelines.io import save_arrays
from pipelines.peers import why_not

ORT = ["ort_training_full", "ort_training_frozen"]
TF = ["tensorflow_full", "tensorflow_frozen"]
TFLITE = ["tflite_full", "tflite_frozen"]
ET = ["executorch_full", "executorch_frozen"]
# Found, not imported: TensorFlow's import loads Keras on its TensorFlow backend for good, and
# the Keras frontend's tests in the same worker need it on JAX. The peers import them in their
# own processes.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name)
            for name in ("onnxruntime", "tensorflow", "executorch")),
    reason="the peers extra is not installed: pip install -e '.[peers]'")


@pytest.mark.parametrize("task, optimizer, reason", [
    ("classification", "Adam", "ONNX Runtime training has SGD and AdamW optimizers, not Adam"),
    ("pair_ranking", "SGD", "this case's task is pair_ranking"),
    ("causal_lm", "AdamW", None)])
def test_onnxruntime_training_says_what_it_cannot_do(task, optimizer, reason):
    signature = {"task": task, "optimizer": {"torch_class": optimizer}}
    for peer in ORT:
        said = why_not(peer, signature, None)
        assert said == reason if reason is None else reason in said


def spec_of(params, build_case, tmp_path_factory, case: str, model: str, optimizer: str):
    compiled = build_case(params, case)
    batch = tmp_path_factory.mktemp("peers") / "batch.npz"
    classes = 2 if compiled.signature["task"] == "classification" else None
    save_arrays(batch, dict(zip(compiled.signature["data"],
                                random_batch(compiled, classes=classes))))
    return Spec(cores=1, warmup=1, steps=2, batch=batch, build=compiled.directory,
                initial=compiled.initial, model=params.models[model],
                optimizer=params.optimizers[optimizer])


def test_tensorflow_says_what_it_cannot_do(small):
    signature = {"task": "classification", "optimizer": {"torch_class": "SGD"}}
    assert "MobileNetV2" in why_not("tensorflow_full", signature, small.models["minilm"])
    assert why_not("tensorflow_full", signature, small.models["mbv2"]) is None
    adam = {**signature, "optimizer": {"torch_class": "AdamW"}}
    assert "not AdamW" in why_not("tensorflow_frozen", adam, small.models["mbv2"])
    for peer in TFLITE:  # the same model, converted
        assert "MobileNetV2" in why_not(peer, signature, small.models["minilm"])
        assert why_not(peer, signature, small.models["mbv2"]) is None


def test_executorch_says_what_it_cannot_do():
    import torch

    from pipelines.peers.executorch_training import refuse_training_norms

    signature = {"task": "classification", "optimizer": {"torch_class": "AdamW"}}
    for peer in ET:
        assert "SGD optimizer only, not AdamW" in why_not(peer, signature, None)
        assert why_not(peer, {**signature, "optimizer": {"torch_class": "SGD"}}, None) is None
        assert "pair_ranking" in why_not(peer, {**signature, "task": "pair_ranking"}, None)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match="batch norm that updates its statistics .1: 1 "):
        refuse_training_norms(model)
    refuse_training_norms(model.eval())  # held statistics lower


# ExecuTorch on mbv2 (the paper's scheme: every batch norm holds its statistics) and on a causal
# LM, its frozen and its full peer. ONNX Runtime on the transformers: the CI lane checks and
# times ort_training_frozen beside every mbv2 case (conf/experiment/ci_lane.yaml). TFLite is
# checked, its full BP (batch norms training, every gradient written in builtins) and the
# scheme, and not timed: timing would convert each model again, and the timing is the same
# harness as TensorFlow's.
@pytest.mark.slow
@pytest.mark.parametrize("case, model, optimizer, checked, timed", [
    ("mbv2", "mbv2", "sgd", [*TF, *TFLITE, "executorch_frozen"], [*TF, "executorch_frozen"]),
    ("minilm_lora", "minilm", "adamw", ORT, ORT),
    ("llama_paper", "llama_tiny", "sgd", [*ORT, "executorch_full"], [*ORT, "executorch_full"])])
def test_peers_agree_with_pytorch_and_are_timed(small, build_case, tmp_path_factory, case,
                                                model, optimizer, checked, timed):
    spec = spec_of(small, build_case, tmp_path_factory, case, model, optimizer)
    losses, failed = check_peers(spec, checked)
    assert failed == {}
    for peer in checked:
        assert len(losses[peer]["peer"]) == 2
    results = time_interleaved(spec, ["compiled", *timed])
    for peer in timed:
        assert results[peer]["steps"] == 2 and results[peer]["median_ms"] > 0


def builtin_gradients_against_tensorflows(_) -> dict:
    """Per convolution shape, the largest difference between the TFLite peers' gradients
    (tflite_training.BuiltinOps) and TensorFlow's own, relative to the gradient's largest."""
    import numpy as np
    import tensorflow as tf

    from pipelines.peers.tflite_training import BuiltinOps
    from pipelines.peers.tensorflow_step import NativeOps

    rng = np.random.default_rng(0)
    worst = {}
    for depthwise, kernel, stride, size in [(False, 1, 1, 8), (False, 3, 2, 9), (False, 3, 2, 8),
                                            (True, 3, 1, 8), (True, 3, 2, 9), (True, 3, 2, 8)]:
        x = tf.constant(rng.standard_normal((2, size, size, 4)), tf.float32)
        k = tf.constant(rng.standard_normal((kernel, kernel, 4, 1 if depthwise else 6)),
                        tf.float32)
        grads = []
        for ops in (NativeOps(), BuiltinOps()):
            convolve = ops.depthwise_conv2d if depthwise else ops.conv2d
            with tf.GradientTape() as tape:
                tape.watch([x, k])
                y = ops.relu6(3 * convolve(x, k, stride))
                loss = tf.reduce_sum(y * tf.cos(y))
            grads.append(tape.gradient(loss, [x, k]))
        worst[(depthwise, kernel, stride, size)] = max(
            float(np.abs(theirs - ours).max() / np.abs(theirs).max())
            for theirs, ours in zip(*grads))
    return worst


@pytest.mark.slow  # TensorFlow in a process of its own (above)
def test_tflite_gradients_in_builtins_are_tensorflows():
    from pipelines.evaluate.speed import in_fresh_process

    worst = in_fresh_process(builtin_gradients_against_tensorflows, None)
    assert len(worst) == 6 and max(worst.values()) < 1e-6, worst
