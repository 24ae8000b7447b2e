"""A TensorFlow peer's training step in a device's container: the step saved as a SavedModel
(pipelines/peers/tensorflow_step.py: ``saved_step``), its ``train`` signature run by
TensorFlow's runtime as an app on the device runs it; the steps' losses, the timed steps' times
and the process's peak resident memory (sampled_peak.py, which travels beside this file).

Usage: python tensorflow_in_container.py SAVED_MODEL INPUTS.npz OUTPUT.json WARMUP STEPS THREADS
INPUTS.npz: the signature's inputs by name (x, channels last; labels). Needs TensorFlow's wheel
and what it imports (images.tensorflow_layers).
"""
import json
import sys

import numpy as np
import tensorflow as tf

from sampled_peak import SampledPeak, timed_steps


def run(saved: str, inputs: str, warmup: int, steps: int, threads: int) -> dict:
    # as the host's peer: the step's operators split over the cores, one at a time
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = tf.saved_model.load(saved)  # holds the variables the signature updates
    train = model.signatures["train"]
    with np.load(inputs) as arrays:
        args = {name: tf.constant(arrays[name]) for name in arrays.files}
    return timed_steps(lambda: train(**args)["loss"].numpy(), warmup, steps)


if __name__ == "__main__":
    with SampledPeak() as peak:
        ran = run(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    with open(sys.argv[3], "w") as handle:
        json.dump({**ran, "peak_rss_bytes": peak.bytes}, handle)
