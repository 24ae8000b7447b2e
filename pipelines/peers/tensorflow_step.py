"""What TensorFlow's peers share (the paper's baseline: its figures are against TensorFlow): the
case's MobileNetV2 (pipelines/models/mobilenetv2.py) written in TensorFlow ops, channels last
as TensorFlow runs convolutions on the CPU, holding the twin's values, trained by one
``tf.function``: forward, ``tf.GradientTape``'s gradients of the trained variables only, and
torch.optim.SGD's update (L2 weight decay, momentum with dampening 0, Nesterov) written in
TensorFlow, so that its losses are PyTorch's doing the same step.

The model is translated module by module from the twin (``Translation``): convolutions
(dense and depthwise), batch norms (batch statistics and running statistics updated as
PyTorch's; held ones normalise with their running statistics), ReLU6, linear layers and the
inverted residual blocks. Other models are not translated: the peer says so. The TFLite peers
(tflite_training.py) trace the same step with their own convolutions, ReLU6 and loss.

In a device's container the step is a SavedModel (``saved_step``: a ``train`` signature over
the model's state as variables), made here in a process of its own and run by TensorFlow's
runtime there (runtime/tensorflow_in_container.py), as the TFLite peers' model is.
"""
from __future__ import annotations

import importlib.util

MODEL_SOURCE = "pipelines/models/mobilenetv2.py"
IMPORTS = ("tensorflow",)
JOB = "job.pickle"  # what ``made_apart`` hands its process


def cannot_time(signature: dict, model) -> str | None:
    if importlib.util.find_spec("tensorflow") is None:
        return "tensorflow is not installed: pip install -e '.[peers]'"
    if model is None or getattr(model, "source", None) != MODEL_SOURCE:
        return f"the TensorFlow peer has the MobileNetV2 of {MODEL_SOURCE} only"
    if signature["optimizer"]["torch_class"] != "SGD":
        return (f"the TensorFlow peer runs SGD, as the MobileNetV2 cases do, not "
                f"{signature['optimizer']['torch_class']}")
    if signature.get("lora"):
        return "the TensorFlow peer has no LoRA adapters"
    return None


class NativeOps:
    """The operators whose gradients TensorFlow's own kernels compute; ``cross_entropy(logits,
    labels)``: each example's."""

    def __init__(self):
        import tensorflow as tf

        self.relu6 = tf.nn.relu6
        self.conv2d = lambda x, kernel, stride: tf.nn.conv2d(x, kernel, stride, "VALID")
        self.depthwise_conv2d = lambda x, kernel, stride: tf.nn.depthwise_conv2d(
            x, kernel, [1, stride, stride, 1], "VALID")
        self.cross_entropy = lambda logits, labels: (
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


class Translation:
    """The twin's modules as TensorFlow functions of channels-last tensors, with a variable
    per parameter and running statistic (by the twin's names); ``ops``: the convolutions,
    ReLU6 and loss (NativeOps, or the TFLite peers' with gradients in TFLite's builtin
    operators)."""

    def __init__(self, twin, trained: list[str], ops=None):
        import tensorflow as tf

        self.tf = tf
        self.ops = ops or NativeOps()
        self.trained = set(trained)
        self.variables: dict[str, object] = {}
        self.forward = self._module(twin, "")

    def _variable(self, name: str, value):
        variable = self.tf.Variable(value, name=name.replace(".", "/"),
                                    trainable=name in self.trained)
        self.variables[name] = variable
        return variable

    def _module(self, module, name: str):
        from torch import nn

        tf = self.tf
        at = f"{name}." if name else ""
        # by class name: the twin's classes are its model file's, loaded as the user's file
        kind = type(module).__name__
        if kind == "MobileNetV2":
            features = self._module(module.features, f"{at}features")
            classifier = self._module(module.classifier, f"{at}classifier")
            return lambda x: classifier(tf.reduce_mean(features(x), axis=[1, 2]))
        if kind == "InvertedResidual":
            inner = self._module(module.conv, f"{at}conv")
            return (lambda x: x + inner(x)) if module.use_residual else inner
        if isinstance(module, nn.Sequential):
            parts = [self._module(child, f"{at}{key}") for key, child in module.named_children()]

            def sequence(x):
                for part in parts:
                    x = part(x)
                return x
            return sequence
        if isinstance(module, nn.Conv2d):
            return self._conv(module, name)
        if isinstance(module, nn.BatchNorm2d):
            return self._batch_norm(module, name)
        if isinstance(module, nn.ReLU6):
            return self.ops.relu6
        if isinstance(module, nn.Dropout) and module.p == 0:
            return lambda x: x
        if isinstance(module, nn.Linear):
            weight = self._variable(f"{at}weight", module.weight.detach().numpy().T)
            bias = self._variable(f"{at}bias", module.bias.detach().numpy())
            return lambda x: tf.matmul(x, weight) + bias
        raise NotImplementedError(f"the TensorFlow peer has no translation of {name!r} "
                                  f"({type(module).__name__})")

    def _conv(self, conv, name: str):
        tf = self.tf
        if conv.bias is not None or conv.dilation != (1, 1):
            raise NotImplementedError(f"the TensorFlow peer's convolutions have no bias or "
                                      f"dilation ({name})")
        weight = conv.weight.detach().numpy()  # (out, in / groups, kh, kw)
        stride, (pad, _) = conv.stride[0], conv.padding
        depthwise = conv.groups == conv.in_channels == conv.out_channels and conv.groups > 1
        if not depthwise and conv.groups != 1:
            raise NotImplementedError(f"the TensorFlow peer has no grouped convolution ({name})")
        # (kh, kw, in, out), or (kh, kw, channels, 1) for a depthwise one
        kernel = self._variable(f"{name}.weight", weight.transpose(2, 3, 0, 1) if depthwise
                                else weight.transpose(2, 3, 1, 0))
        pads = [[0, 0], [pad, pad], [pad, pad], [0, 0]]

        convolve = self.ops.depthwise_conv2d if depthwise else self.ops.conv2d

        def run(x):
            if pad:  # PyTorch pads both sides alike; TensorFlow's "SAME" not at stride 2
                x = tf.pad(x, pads)
            return convolve(x, kernel, stride)
        return run

    def _batch_norm(self, norm, name: str):
        tf = self.tf
        gamma = self._variable(f"{name}.weight", norm.weight.detach().numpy())
        beta = self._variable(f"{name}.bias", norm.bias.detach().numpy())
        mean = self._variable(f"{name}.running_mean", norm.running_mean.numpy())
        var = self._variable(f"{name}.running_var", norm.running_var.numpy())
        momentum, eps = norm.momentum, norm.eps
        if not norm.training:  # its statistics held (models/pytorch.py: hold_statistics)
            return lambda x: tf.nn.batch_normalization(x, mean, var, beta, gamma, eps)

        def run(x):
            batch_mean, batch_var = tf.nn.moments(x, axes=[0, 1, 2])
            count = tf.cast(tf.size(x) // tf.shape(x)[-1], x.dtype)
            # PyTorch's running variance is the unbiased one
            mean.assign((1 - momentum) * mean + momentum * tf.stop_gradient(batch_mean))
            var.assign((1 - momentum) * var + momentum * tf.stop_gradient(
                batch_var * count / (count - 1)))
            return tf.nn.batch_normalization(x, batch_mean, batch_var, beta, gamma, eps)
        return run


def tf_step(spec, signature, batch, frozen: bool):
    """One TensorFlow training step as a callable returning its loss: every parameter of
    the model trained, or with ``frozen`` the scheme's (whole tensors)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(spec.cores)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    train = TrainStep(spec, signature, frozen, NativeOps())
    x, labels = (tf.constant(a) for a in channels_last(batch))

    # autograph off: the step has no tensor-dependent Python control flow to convert, and
    # converting writes a source file per function into /tmp, left there
    @tf.function(autograph=False)
    def step():
        return train(x, labels)
    return lambda: float(step())


def save_step(spec, signature, frozen: bool, batch, ops, directory) -> None:
    """The peer's step with ``ops`` as a SavedModel in ``directory``: one signature,
    ``train(x, labels) -> {loss}``, which updates the model's state (weights, statistics,
    momentum buffers: variables the model holds) in place."""
    import tensorflow as tf

    x, labels = channels_last(batch)

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.step = TrainStep(spec, signature, frozen, ops)
            # tracked, so the model holds them
            self.state = [*self.step.model.variables.values(), *self.step.buffers]

        # autograph off: nothing to convert
        @tf.function(input_signature=[tf.TensorSpec(x.shape, tf.float32),
                                      tf.TensorSpec(labels.shape, tf.int64)], autograph=False)
        def train(self, x, labels):
            return {"loss": self.step(x, labels)}

    module = Module()
    # The gradients are traced into ``train`` already: saving the custom gradients' functions
    # as well (the default) slowed the TFLite conversion by half.
    tf.saved_model.save(module, str(directory), signatures={"train": module.train},
                        options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))


def made_apart(module: str, job: tuple, out, what: str) -> None:
    """``python -m module SCRATCH OUT`` run on ``job`` (pickled into SCRATCH) to make ``out``:
    a model made ahead of time, as a phone's is, in a process of its own, so that TensorFlow's
    tracing and conversion memory is not the training step's. Its temporary files (autograph
    writes its wrappers as source files, removed at an exit a forked process skips) go in
    SCRATCH, removed after it. Raises RuntimeError saying ``what`` failed, with its last line."""
    import os
    import pickle
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="pock-tf-") as scratch:
        (Path(scratch) / JOB).write_bytes(pickle.dumps(job))
        done = subprocess.run([sys.executable, "-m", module, scratch, str(out)],
                              capture_output=True, text=True,
                              env={**os.environ, "TMPDIR": scratch})
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
            raise RuntimeError(f"{what}: {lines[-1]}")


def job_of(scratch: str) -> tuple:
    """The job ``made_apart`` handed this process."""
    import pickle
    from pathlib import Path

    return pickle.loads((Path(scratch) / JOB).read_bytes())


def saved_step(spec, signature, frozen: bool, batch, directory) -> None:
    """``save_step``'s SavedModel of TensorFlow's own step, made apart into ``directory``."""
    made_apart(__name__, (spec, signature, frozen, batch), directory,
               "saving TensorFlow's step")


def channels_last(batch) -> tuple:
    """The step's batch (images NCHW, labels) as TensorFlow takes it: NHWC, int64 labels."""
    import numpy as np

    x, labels = batch
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)), labels.astype(np.int64)


class TrainStep:
    """One training step in TensorFlow ops, to trace: the twin's forward (``ops``' convolutions
    and ReLU6), the loss, ``tf.GradientTape``'s gradients of the trained variables only, and
    torch.optim.SGD's update of them (L2 weight decay, momentum with dampening 0, Nesterov)."""

    def __init__(self, spec, signature, frozen: bool, ops):
        import tensorflow as tf

        from pipelines.peers.pytorch import peer_twin

        self.tf = tf
        twin, names = peer_twin(spec.model, spec.initial, signature, frozen)
        self.model = Translation(twin.train(), names, ops)
        self.trained = [self.model.variables[name] for name in names]
        self.buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.trained]
        self.optimizer = spec.optimizer

    def __call__(self, x, labels):
        """The step's loss."""
        from pipelines.tasks import IGNORE_INDEX

        tf, optimizer, cross_entropy = self.tf, self.optimizer, self.model.ops.cross_entropy
        lr, momentum, decay = optimizer.lr, optimizer.momentum, optimizer.weight_decay
        with tf.GradientTape() as tape:
            logits = self.model.forward(x)
            kept = tf.not_equal(labels, IGNORE_INDEX)
            losses = cross_entropy(logits, tf.where(kept, labels, tf.zeros_like(labels)))
            loss = tf.reduce_sum(tf.where(kept, losses, tf.zeros_like(losses))) / tf.reduce_sum(
                tf.cast(kept, losses.dtype))
        for weight, grad, buffer in zip(self.trained, tape.gradient(loss, self.trained),
                                        self.buffers):
            grad = grad + decay * weight if decay else grad
            if momentum:
                buffer.assign(momentum * buffer + grad)
                grad = grad + momentum * buffer if optimizer.nesterov else buffer
            weight.assign_sub(lr * grad)
        return loss


def first_losses(spec, signature, batch, steps: int, frozen: bool) -> tuple[list, list]:
    """The peer's first losses and PyTorch's doing the same update."""
    from pipelines.peers.pytorch import losses_beside_pytorch

    return losses_beside_pytorch(tf_step(spec, signature, batch, frozen), spec, signature, batch,
                                 steps, frozen, spec.optimizer)


if __name__ == "__main__":  # saved_step's process: python -m pipelines.peers.tensorflow_step
    import sys

    save_step(*job_of(sys.argv[1]), NativeOps(), sys.argv[2])
