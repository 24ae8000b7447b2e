"""A PyTorch peer's training step in a device's container: the model with its loss, saved by
torch.export, trained by torch.optim as the case's optimizer does; the steps' losses, the
timed steps' times and the process's peak resident memory (sampled_peak.py, which travels beside
this file, as for on_device.py).

Usage: python peer_in_container.py PROGRAM.pt2 PLAN.json INPUTS.npz OUTPUT.json WARMUP STEPS
PLAN.json: {"optimizer": a torch.optim class, "groups": [{"params": [[name, ...], ...], its
settings}], "compile": whether torch.compile compiles the forward and backward (Inductor: its
C++ kernels compiled in the first warm-up step, as on the host)}, each trained parameter by its
names (a tied one has several: the module torch.export gives back holds one parameter per
name, sharing storage, and its graph reads one of them, which is the one trained); every other
parameter is frozen. INPUTS.npz: the program's arguments in
call order (arg_000, ...). Needs only PyTorch and numpy (images.pytorch_layers), as on_device.py
needs only TVM's runtime.
"""
import json
import sys

import numpy as np
import torch

from sampled_peak import SampledPeak, timed_steps


def run(program: str, plan_file: str, inputs: str, warmup: int, steps: int) -> dict:
    module = torch.export.load(program).module()
    read = {node.target for node in module.graph.nodes if node.op == "get_attr" and node.users}
    with open(plan_file) as handle:
        plan = json.load(handle)
    params = dict(module.named_parameters())
    for param in params.values():
        param.requires_grad_(False)
    groups = []
    for group in plan["groups"]:
        trained = [params[next(n for n in names if n in read)] for names in group["params"]]
        for param in trained:
            param.requires_grad_(True)
        groups.append({**group, "params": trained})
    optimizer = getattr(torch.optim, plan["optimizer"])(groups)
    with np.load(inputs) as arrays:
        args = [torch.from_numpy(arrays[name]) for name in sorted(arrays.files)]
    forward = torch.compile(module) if plan["compile"] else module
    checked = False

    def step():
        nonlocal checked
        optimizer.zero_grad(set_to_none=True)
        loss = forward(*args)
        loss.backward()
        if not checked:  # an update that would skip a trained tensor is not the case's
            untouched = [n for n, p in params.items() if p.requires_grad and p.grad is None]
            if untouched:
                raise RuntimeError(f"trained parameters got no gradient: {untouched}")
            checked = True
        optimizer.step()
        return loss.item()
    return {**timed_steps(step, warmup, steps), "trained": sum(len(g["params"]) for g in groups),
            "trained_elements": sum(p.numel() for g in groups for p in g["params"])}


if __name__ == "__main__":
    with SampledPeak() as peak:
        ran = run(*sys.argv[1:4], int(sys.argv[5]), int(sys.argv[6]))
    with open(sys.argv[4], "w") as handle:
        json.dump({**ran, "peak_rss_bytes": peak.bytes}, handle)
