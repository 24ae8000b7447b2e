"""An ExecuTorch training peer's steps in a device's container: the program made here
(pipelines/peers/executorch_training.py: the joint forward and backward graph, lowered to a
``.pte``) run by ExecuTorch's runtime with its SGD, as an app runs the program it ships; the
steps' losses, the timed steps' times and the process's peak resident memory (sampled_peak.py,
which travels beside this file).

Usage: python executorch_in_container.py PROGRAM.pte INPUTS.npz OUTPUT.json WARMUP STEPS
       LR MOMENTUM WEIGHT_DECAY NESTEROV
INPUTS.npz: the program's inputs in order (arg_000, ...), the labels last. Needs ExecuTorch's
wheel and what its runtime's Python binding imports: PyTorch (its tensors), numpy and three
small packages (images.executorch_layers).
"""
import json
import sys

import numpy as np
import torch
from executorch.extension.training import _load_for_executorch_for_training, get_sgd_optimizer

from sampled_peak import SampledPeak, timed_steps


def run(program: str, inputs: str, warmup: int, steps: int, sgd: tuple) -> dict:
    module = _load_for_executorch_for_training(program)
    with np.load(inputs) as arrays:
        args = tuple(torch.from_numpy(arrays[name]) for name in sorted(arrays.files))
    module.forward_backward("forward", args)  # its parameters are known after a first call
    lr, momentum, weight_decay, nesterov = sgd
    optimizer = get_sgd_optimizer(module.named_parameters(), lr, momentum, 0.0, weight_decay,
                                  nesterov)

    def step():
        loss = module.forward_backward("forward", args)[0]
        optimizer.step(module.named_gradients())
        return loss
    return timed_steps(step, warmup, steps)


if __name__ == "__main__":
    sgd = (float(sys.argv[6]), float(sys.argv[7]), float(sys.argv[8]), sys.argv[9] == "True")
    with SampledPeak() as peak:
        ran = run(sys.argv[1], sys.argv[2], int(sys.argv[4]), int(sys.argv[5]), sgd)
    with open(sys.argv[3], "w") as handle:
        json.dump({**ran, "peak_rss_bytes": peak.bytes}, handle)
