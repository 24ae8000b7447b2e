"""Fine-tuning's checkpoints: everything a run needs to go on where it stopped, written
atomically every ``finetune.checkpoint_every`` steps (finetune.py), so that a run killed at any
point and run again ends with the same weights as one that was never interrupted.

A checkpoint holds the compiled step's state (weights, buffers, optimizer state), PyTorch's
reference model and its optimizer state, PyTorch's random state, and the run's position and
record (the epoch, its next step, the losses and held-out evaluations so far). The batches'
order is a function of the seed and the epoch (models/pytorch.py: batches), so the position says
which batches come next. Nothing in it is a pickle.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipelines.frontends.weights import (load_optimizer_state, load_weights,
                                         save_optimizer_state, save_weights)
from pipelines.io import atomic_dir, load_arrays, read_json, save_arrays, write_json_atomic

COMPILED, REFERENCE, OPTIMIZER, PROGRESS = ("compiled.npz", "reference.safetensors",
                                            "optimizer.safetensors", "progress.json")


@dataclass
class Position:
    epoch: int  # the epoch in progress
    next: int  # the index of its next step (a step: gradient_accumulation_steps batches)
    losses: list[dict]
    evaluations: list[dict]


def save(directory: Path, position: Position, compiled, reference: torch.nn.Module,
         optimizer) -> None:
    """The run as it stands after ``position``, replacing the last checkpoint in one rename."""
    with atomic_dir(directory) as tmp:
        save_arrays(tmp / COMPILED, {n: v.numpy() for n, v in compiled.state.items()})
        save_weights({**reference.state_dict(), "torch_rng_state": torch.get_rng_state()},
                     tmp / REFERENCE)
        save_optimizer_state(optimizer.state_dict(), tmp / OPTIMIZER)
        write_json_atomic(tmp / PROGRESS, {"epoch": position.epoch, "next": position.next,
                                           "losses": position.losses,
                                           "evaluations": position.evaluations,
                                           "steps": compiled.steps})


def restore(directory: Path, compiled, reference: torch.nn.Module, optimizer) -> Position | None:
    """The last checkpoint in ``directory`` loaded into the run's objects, and its position;
    None where there is none."""
    if not (Path(directory) / PROGRESS).exists():
        return None
    progress = read_json(Path(directory) / PROGRESS)
    import tvm

    for name, value in load_arrays(Path(directory) / COMPILED).items():
        compiled.set_state(name, tvm.runtime.tensor(np.asarray(value, order="C"), compiled.device))
    compiled.steps = progress["steps"]
    state = load_weights(Path(directory) / REFERENCE)
    torch.set_rng_state(state.pop("torch_rng_state"))
    reference.load_state_dict(state, strict=False)
    optimizer.load_state_dict(load_optimizer_state(Path(directory) / OPTIMIZER))
    return Position(progress["epoch"], progress["next"], progress["losses"],
                    progress["evaluations"])
