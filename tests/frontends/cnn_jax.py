"""The frontend tests' small CNN written in JAX: conv 3->8, ReLU, 2x2 max pool, conv 8->16,
ReLU, spatial mean, linear 16->10, on 16x16 RGB images (NCHW, PyTorch's layouts, so the same
weights load on every side). conf/model/jax.yaml points at ``model``. JAX is imported where it
is used: the tests' other frontends share ``init`` without it."""
import numpy as np

IMAGE = (3, 16, 16)


def conv(x, layer):
    from jax import lax

    y = lax.conv_general_dilated(x, layer["weight"], (1, 1), ((1, 1), (1, 1)),
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + layer["bias"][None, :, None, None]


def apply(params, x):
    import jax
    import jax.numpy as jnp
    from jax import lax

    y = jax.nn.relu(conv(x, params["conv1"]))
    y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    y = jax.nn.relu(conv(y, params["conv2"])).mean((2, 3))
    return y @ params["fc"]["weight"].T + params["fc"]["bias"]


def init(seed: int = 0) -> dict:
    """PyTorch's default initialisation bounds (uniform, 1/sqrt(fan_in))."""
    rng = np.random.default_rng(seed)

    def layer(shape):
        bound = 1 / np.sqrt(np.prod(shape[1:]))
        return {"weight": rng.uniform(-bound, bound, shape).astype("float32"),
                "bias": rng.uniform(-bound, bound, shape[0]).astype("float32")}

    return {"conv1": layer((8, 3, 3, 3)), "conv2": layer((16, 8, 3, 3)), "fc": layer((10, 16))}


def model(batch_size: int):
    """What the import stage asks of a JAX model file: (apply, params, example input)."""
    return apply, init(), np.zeros((batch_size, *IMAGE), "float32")
