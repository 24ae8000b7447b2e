"""An ONNX Runtime training peer's steps in a device's container: the training artifacts made
here (pipelines/peers/onnxruntime_training.py: the training model, its checkpoint and the
optimizer model) run by ONNX Runtime's training API, as an app runs them; the steps' losses,
the timed steps' times and the process's peak resident memory (sampled_peak.py, which travels
beside this file).

Usage: python ort_in_container.py ARTIFACTS INPUTS.npz OUTPUT.json WARMUP STEPS THREADS LR
INPUTS.npz: the training model's inputs in order (arg_000, ...), the labels last. Needs only
ONNX Runtime training's wheel and numpy (images.ort_layers).
"""
import json
import os
import sys
import types

import numpy as np
import onnxruntime

from sampled_peak import SampledPeak, timed_steps

# onnxruntime.training's own __init__ imports its PyTorch and ONNX integrations (ORTModule,
# the artifact builder); its training API (api/) needs neither, so the package is entered
# without running that __init__.
_training = types.ModuleType("onnxruntime.training")
_training.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
sys.modules["onnxruntime.training"] = _training
from onnxruntime.training import api  # noqa: E402


def run(artifacts: str, inputs: str, warmup: int, steps: int, threads: int, lr: float) -> dict:
    onnxruntime.set_default_logger_severity(3)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    state = api.CheckpointState.load_checkpoint(os.path.join(artifacts, "checkpoint"))
    module = api.Module(os.path.join(artifacts, "training_model.onnx"), state,
                        session_options=options)
    optimizer = api.Optimizer(os.path.join(artifacts, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(lr)
    module.train()
    with np.load(inputs) as arrays:
        args = [arrays[name] for name in sorted(arrays.files)]

    def step():
        loss = module(*args)
        optimizer.step()
        module.lazy_reset_grad()
        return loss
    return timed_steps(step, warmup, steps)


if __name__ == "__main__":
    with SampledPeak() as peak:
        ran = run(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]),
                  int(sys.argv[6]), float(sys.argv[7]))
    with open(sys.argv[3], "w") as handle:
        json.dump({**ran, "peak_rss_bytes": peak.bytes}, handle)
