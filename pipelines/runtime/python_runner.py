"""The Python runner: the native runner's twin (native_runner.cc) on TVM's Python runtime, for
development and for checking the native one. The same command line, step directory, data and
outputs, the same batch order; both must give the same weights.

  python pipelines/runtime/python_runner.py STEP_DIR --data DIR --out DIR [--epochs 1]
                                             [--steps N] [--seed 0] [--state FILE]

Needs numpy, safetensors and TVM's runtime only (no PyTorch, no compiler), and ml_dtypes for a
step that stores frozen weights in bfloat16. A step built for an NVIDIA GPU runs there, as in
the native runner. Exit codes as the native runner's: 0 done; 2 bad input; 3 a step's loss
or new state is not finite.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as pipelines/backend/cpu_schedules.py says why
import tvm  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.numpy import save  # noqa: E402
from tvm.runtime.vm import VirtualMachine  # noqa: E402

from pipelines.io import load_tensors, write_json_atomic, write_text_atomic  # noqa: E402
from pipelines.runtime.checks import (StepError, check_batch, check_finite,  # noqa: E402
                                      check_shapes)
from pipelines.runtime.cuda import cuda_device, keep  # noqa: E402
from pipelines.runtime.peak_memory import peak_resident_bytes  # noqa: E402

MASK = (1 << 64) - 1


def shuffled(n: int, rng: list[int]) -> list[int]:
    """range(n) shuffled as the native runner does (Fisher-Yates on splitmix64): ``rng`` holds
    the generator's state, advanced here."""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        rng[0] = (rng[0] + 0x9E3779B97F4A7C15) & MASK
        z = rng[0]
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        j = (z ^ (z >> 31)) % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class BadInput(Exception):
    """Exit code 2."""


def save_atomic(arrays: dict[str, np.ndarray], path: Path) -> None:
    """``arrays`` as safetensors at ``path``, complete or not at all."""
    write_text_atomic(path, save(arrays))


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise BadInput(f"{path}: not found")
    try:
        return load_tensors(path)
    except SafetensorError as err:
        raise BadInput(f"{path}: not a safetensors file ({err})") from None


def read_data(path: Path, manifest: dict) -> tuple[list[np.ndarray], int]:
    """The data inputs' examples, in the step's order, and how many there are."""
    tensors = read_tensors(path)
    wanted = " and ".join(f"{d['name']} {d['dtype']} [N{''.join(f', {s}' for s in d['example'])}]"
                          for d in manifest["data"])
    arrays, count = [], None
    for d in manifest["data"]:
        if d["name"] not in tensors:
            raise BadInput(f"{path}: no tensor '{d['name']}'; needs {wanted}")
        a = tensors[d["name"]]
        if (str(a.dtype) != d["dtype"] or a.ndim == 0 or list(a.shape[1:]) != d["example"]
                or count not in (None, len(a))):
            raise BadInput(f"{path}: tensor '{d['name']}' is {a.dtype} {list(a.shape)}; "
                           f"allowed: {wanted}, the same N for all")
        arrays.append(a)
        count = len(a)
    batch = manifest["batch"]
    if count < batch:
        raise BadInput(f"{path}: {count} examples, fewer than one batch of {batch}")
    signature = {"labels": manifest["labels"] and {k: manifest["labels"][k]
                                                   for k in ("classes", "ignore_index")},
                 "data_types": {d["name"]: d for d in manifest["data"]}}
    try:
        check_batch(signature, {d["name"]: a for d, a in zip(manifest["data"], arrays)},
                    str(path))
    except StepError as err:
        raise BadInput(str(err)) from None
    return arrays, count


def run(args) -> int:
    manifest = json.loads((args.step_dir / "runner.json").read_text())
    for flag, value, least in (("--epochs", args.epochs, 1), ("--seed", args.seed, 0)):
        if value < least:
            raise BadInput(f"{flag} {value}: allowed: an integer >= {least}")
    if not args.out.is_dir():
        raise BadInput(f"{args.out}: not a directory; give one to receive the weights")
    data, count = read_data(args.data / "train.safetensors", manifest)
    state_path = args.state or args.step_dir / "state.safetensors"
    saved = read_tensors(state_path)
    types = {t["name"]: t for t in manifest["state"]}
    missing = [n for n in types if n not in saved]
    if missing:
        raise BadInput(f"{state_path}: no tensor {missing[:5]}; needs the step's state")
    try:  # once: the built step does not check its inputs
        check_shapes(types, {n: saved[n] for n in types}, str(state_path), "tensor")
    except StepError as err:
        raise BadInput(str(err)) from None
    gpu = manifest.get("device", "cpu") == "cuda"
    device = cuda_device() if gpu else tvm.cpu()
    vm = VirtualMachine(tvm.runtime.load_module(str(args.step_dir / "step.so")), device)
    tvm.runtime.empty((1,), "float32", device)  # a GPU's context, before its memory is read
    free_at_start = least_free = device.available_global_memory if gpu else None
    state = {n: tvm.runtime.tensor(saved[n], device) for n in types}
    resident = manifest.get("resident", False)  # cuda.keep says why
    batch = manifest["batch"]
    rng, losses, step_ms, order_log = [args.seed], [], [], []
    began = time.perf_counter()
    for epoch in range(args.epochs):
        if len(losses) == args.steps:
            break
        order = shuffled(count, rng)
        for start in range(0, count - batch + 1, batch):
            if len(losses) == args.steps:
                break
            index = order[start:start + batch]
            started = time.perf_counter()
            outputs = list(vm["train_step"](
                *[tvm.runtime.tensor(a[index].reshape(d["shape"]), device)
                  for a, d in zip(data, manifest["data"])],
                *[state[n] for n in types]))
            loss = outputs[0].numpy()  # on a GPU, waits for the step
            step_ms.append(1e3 * (time.perf_counter() - started))
            if gpu:
                least_free = min(least_free, device.available_global_memory)
            where = f"step {len(losses) + 1}"
            check_finite({"loss": loss, **({} if gpu else {
                n: np.from_dlpack(v) for n, v in zip(manifest["updates"], outputs[1:])})},
                where, True)
            for name, value in zip(manifest["updates"], outputs[1:]):
                keep(state, name, value, resident)
            losses.append(float(loss))
            order_log.extend(index)
        arrays = {n: v.numpy() for n, v in state.items()}
        if gpu:  # checked only here; on the CPU, every step checked its new state
            check_finite(arrays, f"epoch {epoch + 1}", True)
        save_atomic(arrays, args.out / "state.safetensors")  # a checkpoint per epoch
        print(f"epoch {epoch + 1}/{args.epochs}: mean loss "
              f"{np.mean(losses[-(count // batch):]):.4f}", flush=True)
    seconds = time.perf_counter() - began
    save_atomic({source: arrays[n] for n, source in manifest["weights"].items() if n in arrays},
                args.out / "weights.safetensors")
    write_json_atomic(args.out / "log.json", {
        "runner": "python", "epochs": args.epochs, "seed": args.seed, "steps": len(losses),
        "seconds": seconds, "peak_rss_bytes": peak_resident_bytes(),
        "device": "cuda" if gpu else "cpu",
        "device_held_bytes": free_at_start - least_free if gpu else None, "losses": losses,
        "step_ms": step_ms, "order": order_log})
    print(f"wrote {args.out}/weights.safetensors, state.safetensors and log.json "
          f"({len(losses)} steps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step_dir", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state", type=Path)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BadInput as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
