"""What the TFLite (LiteRT) peers share: TensorFlow's peer step (tensorflow_step.py: the twin
in TensorFlow ops, the loss, the gradients of the trained variables, SGD) as a TFLite model
with a ``train`` signature whose variables the step updates in place, converted and run by
LiteRT's interpreter: how a TensorFlow model trains on a phone.

TFLite has no builtin gradient of a convolution's filter, of a depthwise convolution, of ReLU6
or of the fused cross-entropy: TensorFlow's own gradients of them convert only as Select
TensorFlow ops, run by the Flex delegate, which neither tensorflow nor ai-edge-litert on PyPI
ships (the interpreter refuses such a model). So the step is traced with ``BuiltinOps``, whose
gradients are written in operators TFLite has, and converted with builtins only:

- a convolution's input gradient is TensorFlow's (``Conv2DBackpropInput``, TFLite's
  TRANSPOSE_CONV); its filter's is, per kernel offset, the strided slice of the input it met
  times the output gradient, one matrix product (BATCH_MATMUL);
- a depthwise convolution's input gradient is the depthwise convolution of the output
  gradient, spread to the stride with zeros and padded, by the flipped kernel; its filter's
  the per-channel sum of slice times gradient;
- ReLU6's passes the gradient where 0 < x < 6 (SELECT_V2); the loss is the log-softmax's
  value at each label (LOG_SOFTMAX, ONE_HOT), whose gradient TensorFlow writes in builtins.
"""
from __future__ import annotations

import importlib.util

from pipelines.peers.tensorflow_step import cannot_time as tensorflow_cannot_time

IMPORTS = ("ai_edge_litert.interpreter",)  # TensorFlow converts, in a process of its own


def cannot_time(signature: dict, model) -> str | None:
    if importlib.util.find_spec("ai_edge_litert") is None:
        return "ai-edge-litert (LiteRT) is not installed: pip install -e '.[peers]'"
    return tensorflow_cannot_time(signature, model)


class BuiltinOps:
    """The convolutions and ReLU6 of tensorflow_step.Translation, with gradients in TFLite's
    builtin operators (above). Inputs are padded already: every convolution is "VALID"."""

    def __init__(self):
        import tensorflow as tf

        self.tf = tf
        self.relu6 = tf.custom_gradient(self._relu6)

    def cross_entropy(self, logits, labels):
        """Each example's: the log-softmax at its label, whose gradient is in builtins."""
        tf = self.tf
        return -tf.reduce_sum(tf.one_hot(labels, logits.shape[-1]) * tf.nn.log_softmax(logits),
                              axis=-1)

    def _relu6(self, x):
        tf = self.tf

        def gradient(dy):
            return tf.where(tf.logical_and(x > 0, x < 6), dy, tf.zeros_like(dy))
        return tf.clip_by_value(x, 0.0, 6.0), gradient

    def _windows(self, x, out_shape, kernel_shape, stride):
        """Per kernel offset (row-major), the input elements that offset met: strided slices
        of ``x`` shaped as the output."""
        _, h, w, _ = out_shape
        return [x[:, i:i + stride * (h - 1) + 1:stride, j:j + stride * (w - 1) + 1:stride, :]
                for i in range(kernel_shape[0]) for j in range(kernel_shape[1])]

    def conv2d(self, x, kernel, stride: int):
        tf = self.tf

        @tf.custom_gradient
        def convolve(x, kernel):
            y = tf.nn.conv2d(x, kernel, stride, "VALID")

            def gradient(dy):
                kh, kw, cin, cout = kernel.shape
                dx = tf.nn.conv2d_transpose(dy, kernel, x.shape, stride, "VALID")
                rows = dy.shape[0] * dy.shape[1] * dy.shape[2]
                flat_dy = tf.reshape(dy, [rows, cout])
                dk = tf.stack([tf.matmul(tf.reshape(window, [rows, cin]), flat_dy,
                                         transpose_a=True)
                               for window in self._windows(x, dy.shape, kernel.shape, stride)])
                return dx, tf.reshape(dk, [kh, kw, cin, cout])
            return y, gradient
        return convolve(x, kernel)

    def depthwise_conv2d(self, x, kernel, stride: int):
        tf = self.tf

        @tf.custom_gradient
        def convolve(x, kernel):
            y = tf.nn.depthwise_conv2d(x, kernel, [1, stride, stride, 1], "VALID")

            def gradient(dy):
                kh, kw, channels, _ = kernel.shape
                spread = self._spread(dy, stride)
                full = tf.nn.depthwise_conv2d(
                    tf.pad(spread, [[0, 0], [kh - 1, kh - 1], [kw - 1, kw - 1], [0, 0]]),
                    tf.reverse(kernel, [0, 1]), [1, 1, 1, 1], "VALID")
                # the input rows and columns no window reached (stride's remainder) get zero
                dx = tf.pad(full, [[0, 0], [0, x.shape[1] - full.shape[1]],
                                   [0, x.shape[2] - full.shape[2]], [0, 0]])
                dk = tf.stack([tf.reduce_sum(window * dy, axis=[0, 1, 2])
                               for window in self._windows(x, dy.shape, kernel.shape, stride)])
                return dx, tf.reshape(dk, [kh, kw, channels, 1])
            return y, gradient
        return convolve(x, kernel)

    def _spread(self, dy, stride: int):
        """``dy`` with stride - 1 zeros after each row and column but the last."""
        tf = self.tf
        if stride == 1:
            return dy
        n, h, w, c = dy.shape
        zero = tf.zeros_like(dy)
        dy = tf.reshape(tf.stack([dy] + [zero] * (stride - 1), axis=3), [n, h, w * stride, c])
        zero = tf.zeros_like(dy)
        dy = tf.reshape(tf.stack([dy] + [zero] * (stride - 1), axis=2),
                        [n, h * stride, w * stride, c])
        return dy[:, :(h - 1) * stride + 1, :(w - 1) * stride + 1, :]


def convert(spec, signature, frozen: bool, batch) -> bytes:
    """The TFLite model of the peer's step: one signature, ``train(x, labels) -> {loss}``,
    builtin operators only, the model's state as resource variables."""
    import tempfile

    import tensorflow as tf

    from pipelines.peers.tensorflow_step import save_step

    with tempfile.TemporaryDirectory() as saved:
        save_step(spec, signature, frozen, batch, BuiltinOps(), saved)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=["train"])
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        converter.experimental_enable_resource_variables = True
        return converter.convert()


def converted(spec, signature, frozen: bool, batch) -> bytes:
    """``convert``'s model, made apart (tensorflow_step.made_apart): the converter's memory
    (TensorFlow's traced graphs, MLIR) is not the training step's."""
    import tempfile
    from pathlib import Path

    from pipelines.peers.tensorflow_step import made_apart

    with tempfile.TemporaryDirectory(prefix="pock-tflite-") as out:
        model = Path(out) / "model.tflite"
        made_apart(__name__, (spec, signature, frozen, batch), model, "converting to TFLite")
        return model.read_bytes()


def tflite_step(spec, signature, batch, frozen: bool):
    """One LiteRT training step as a callable returning its loss: every parameter of the
    model trained, or with ``frozen`` the scheme's (whole tensors)."""
    from ai_edge_litert.interpreter import Interpreter

    from pipelines.peers.tensorflow_step import channels_last

    interpreter = Interpreter(model_content=converted(spec, signature, frozen, batch),
                              num_threads=spec.cores)
    train = interpreter.get_signature_runner("train")
    x, labels = channels_last(batch)
    return lambda: float(train(x=x, labels=labels)["loss"])


def first_losses(spec, signature, batch, steps: int, frozen: bool) -> tuple[list, list]:
    """The peer's first losses and PyTorch's doing the same update."""
    from pipelines.peers.pytorch import losses_beside_pytorch

    return losses_beside_pytorch(tflite_step(spec, signature, batch, frozen), spec, signature,
                                 batch, steps, frozen, spec.optimizer)


if __name__ == "__main__":  # converted's process: python -m pipelines.peers.tflite_training
    import sys
    from pathlib import Path

    from pipelines.peers.tensorflow_step import job_of

    Path(sys.argv[2]).write_bytes(convert(*job_of(sys.argv[1])))
