"""The frontend tests' small CNN as a Keras model (channels-last, as Keras lays out images and
kernels): conv 3->8, ReLU, 2x2 max pool, conv 8->16, ReLU, global mean, dense 16->10.
``build`` loads tests/frontends/cnn_jax.py's weights into it, transposed to Keras's layouts."""
import numpy as np

from pipelines.frontends.keras import load_keras
from tests.frontends.cnn_jax import IMAGE, init


def to_keras(name: str, value: np.ndarray) -> np.ndarray:
    """A PyTorch-layout weight in Keras's layout: conv OIHW -> HWIO, dense [out, in] -> [in, out]."""
    if value.ndim == 4:
        return value.transpose(2, 3, 1, 0)
    return value.T if value.ndim == 2 else value


def build():
    keras = load_keras()
    channels, height, width = IMAGE
    model = keras.Sequential([
        keras.Input((height, width, channels)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, name="fc")], name="cnn")
    weights = init()
    for layer in ("conv1", "conv2", "fc"):
        model.get_layer(layer).set_weights([to_keras(layer, weights[layer]["weight"]),
                                            weights[layer]["bias"]])
    return model
