"""The peers a compiled step is timed beside (evaluate@<case>, ``benchmark.peers``): other ways
to do the same training step on the same machine, each timed in its own process on the same
batch and thread count (pipelines/evaluate/speed.py).

A peer is a module here, registered in PEERS (pipelines/registry.py) under its module name, with
    WORK                               "full" or "pruned": whose FLOPs its step computes (the
                                       prune report's full or pruned step), for GFLOP/s
    make_step(spec, signature, batch)  a callable that runs one training step; ``spec`` is
                                       evaluate/speed.py's Spec (the initial state in
                                       ``spec.initial``), ``signature`` the built step's
                                       (pipelines/ir.py), ``batch`` the step's arrays in its
                                       order. The compiled step itself is not loaded in a
                                       peer's process: its state is not the peer's memory
    cannot_time(signature, model)      optional: why the peer cannot do the case whose step
                                       has this signature, of this model (a config's model
                                       section), as a string, or None; such a case's
                                       metrics say so instead of a time
    IMPORTS                            optional: the libraries the peer runs on, imported
                                       before its memory baseline (as PyTorch and TVM are)
    check_losses(spec, signature, batch, steps)
                                       for a peer that is not PyTorch: its losses over its first
                                       ``steps`` on ``batch`` and PyTorch's doing the same
                                       update; a peer whose losses are not PyTorch's, or that
                                       fails, is reported so and not timed

A peer from another package is an optional extra (``pip install -e '.[peers]'``): without it,
``cannot_time`` says how to install it.
"""
from __future__ import annotations

from pipelines.registry import entries

PEERS = entries(__name__, ("torch_eager_full", "torch_eager_frozen", "torch_compile_full",
                             "peft_lora", "ort_training_full", "ort_training_frozen",
                             "tensorflow_full", "tensorflow_frozen", "tflite_full",
                             "tflite_frozen", "executorch_full", "executorch_frozen"))


def why_not(peer: str, signature: dict, model) -> str | None:
    """Why ``peer`` cannot time the case whose step has ``signature``, of ``model`` (a
    config's model section), or None."""
    check = getattr(PEERS[peer], "cannot_time", None)
    return check(signature, model) if check else None
