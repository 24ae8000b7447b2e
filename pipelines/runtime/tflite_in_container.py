"""A TFLite (LiteRT) peer's training step in a device's container: the converted model's
``train`` signature (pipelines/peers/tflite_training.py), run by LiteRT's interpreter as a
phone's app runs it; the steps' losses, the timed steps' times and the process's peak resident
memory (sampled_peak.py, which travels beside this file).

Usage: python tflite_in_container.py MODEL.tflite INPUTS.npz OUTPUT.json WARMUP STEPS THREADS
INPUTS.npz: the signature's inputs by name (x, channels last; labels). Needs only LiteRT's
wheel and numpy (images.litert_layers).
"""
import json
import sys

import numpy as np
from ai_edge_litert.interpreter import Interpreter

from sampled_peak import SampledPeak, timed_steps


def run(model: str, inputs: str, warmup: int, steps: int, threads: int) -> dict:
    train = Interpreter(model_path=model, num_threads=threads).get_signature_runner("train")
    with np.load(inputs) as arrays:
        args = {name: arrays[name] for name in arrays.files}
    return timed_steps(lambda: train(**args)["loss"], warmup, steps)


if __name__ == "__main__":
    with SampledPeak() as peak:
        ran = run(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    with open(sys.argv[3], "w") as handle:
        json.dump({**ran, "peak_rss_bytes": peak.bytes}, handle)
