"""The packaged image's entrypoint: fine-tune on a mounted data directory, write the weights.

Usage (inside the image; `docker run IMAGE --help`):
  python3 /app/finetune.py [--data /data] [--out /out] [--epochs 1] [--seed 0]
                           [--state /app/state.npz]
Reads DATA/train.npz: ``x`` float32 [N, *input shape], ``y`` int64 [N] (package.json says the
shapes). Runs the compiled training step over it in batches of package.json's batch size
(shuffled per epoch with --seed; a last partial batch is dropped: the step has fixed shapes),
then writes into OUT, each file complete or not at all:
- weights.npz: parameters and buffers under their PyTorch state_dict names;
- state.npz: the whole training state (weights and optimizer state) under the step's input
  names; pass it as --state to go on where this run stopped;
- log.json: the loss of every step, the seconds the steps took and the process's peak
  resident memory.
Needs only numpy and TVM's runtime (the image has no PyTorch).

Exit codes: 0 done; 2 bad input (no train.npz, wrong shapes, labels out of range, non-finite
values: the message names the file and what is allowed); 3 a step's loss or new state was not
finite (the message names the step and the tensor). Nothing is written unless it succeeds.
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

# One TVM thread per CPU this container may use (TVM would count the host's CPUs).
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as pipelines/backend/cpu_schedules.py says why
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

try:  # in the image, checks.py is beside this file
    from checks import StepError, check_batch, check_finite
except ImportError:  # imported from the library (runtime/package.py reads epoch_batches)
    from pipelines.runtime.checks import StepError, check_batch, check_finite

APP = Path(__file__).resolve().parent


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_data(path: Path, batch: int, shapes: dict, signature: dict
              ) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        fail(f"{path}: not found; mount a directory holding train.npz with arrays x and y")
    with np.load(path) as data:
        if not {"x", "y"} <= set(data.files):
            fail(f"{path}: holds {sorted(data.files)}; needs arrays 'x' and 'y'")
        x, y = data["x"].astype(shapes["x"]["dtype"]), data["y"].astype(shapes["y"]["dtype"])
    if list(x.shape[1:]) != shapes["x"]["shape"][1:] or len(y) != len(x) or y.ndim != 1:
        fail(f"{path}: x is {list(x.shape)} and y {list(y.shape)}; allowed: x [N, "
             f"{', '.join(map(str, shapes['x']['shape'][1:]))}] and y [N]")
    if len(x) < batch:
        fail(f"{path}: {len(x)} examples, fewer than one batch of {batch}")
    x_name, labels = signature["data"][0], signature["data"][-1]
    try:
        check_batch(signature, {x_name: x, labels: y}, str(path))
    except StepError as err:
        fail(str(err))
    return x, y


def epoch_batches(n: int, batch: int, rng: np.random.Generator):
    """Index arrays of one epoch's batches: shuffled by ``rng``, the last partial one dropped
    (the step has fixed shapes)."""
    order = rng.permutation(n)
    for start in range(0, n - batch + 1, batch):
        yield order[start:start + batch]


def save_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        write(handle)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/data"))
    parser.add_argument("--out", type=Path, default=Path("/out"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state", type=Path, default=APP / "state.npz")
    args = parser.parse_args()
    package = json.loads((APP / "package.json").read_text())
    signature = json.loads((APP / "signature.json").read_text())
    batch = package["batch_size"]
    x, y = load_data(args.data / "train.npz", batch, package["inputs"], signature)
    if not args.out.is_dir():
        fail(f"{args.out}: not a directory; mount one to receive the weights")

    device = tvm.cpu()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(APP / "step.so")), device)
    names = signature["inputs"][len(signature["data"]):]
    with np.load(args.state) as saved:
        missing = [n for n in names if n not in saved.files]
        if missing:
            fail(f"{args.state}: no value for {missing[:5]}")
        state = {n: tvm.runtime.tensor(saved[n], device) for n in names}
    updates = [n.removeprefix("new_") for n in signature["outputs"][1:]]
    rng, losses, began = np.random.default_rng(args.seed), [], time.perf_counter()
    for epoch in range(args.epochs):
        for index in epoch_batches(len(x), batch, rng):
            outputs = list(vm["train_step"](
                tvm.runtime.tensor(np.ascontiguousarray(x[index]), device),
                tvm.runtime.tensor(np.ascontiguousarray(y[index]), device),
                *[state[n] for n in names]))
            try:
                check_finite({"loss": outputs[0].numpy(),
                              **{n: np.from_dlpack(v) for n, v in zip(updates, outputs[1:])}},
                             f"step {len(losses) + 1}", bool(signature.get("updated_in_place")))
            except StepError as err:
                print(f"error: {err}", file=sys.stderr)
                sys.exit(3)
            for name, value in zip(updates, outputs[1:]):
                state[name] = value
            losses.append(float(outputs[0].numpy()))
        print(f"epoch {epoch + 1}/{args.epochs}: mean loss "
              f"{np.mean(losses[-(len(x) // batch):]):.4f}", flush=True)

    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    arrays = {n: v.numpy() for n, v in state.items()}
    torch_names = signature["source_names"]
    save_atomic(args.out / "weights.npz", lambda h: np.savez(
        h, **{torch_names[n]: v for n, v in arrays.items() if n in torch_names}))
    save_atomic(args.out / "state.npz", lambda h: np.savez(h, **arrays))
    save_atomic(args.out / "log.json", lambda h: h.write(json.dumps(
        {"epochs": args.epochs, "seed": args.seed, "steps": len(losses), "seconds": seconds,
         "peak_rss_bytes": peak, "losses": losses}, indent=1).encode()))
    print(f"wrote {args.out}/weights.npz, state.npz and log.json ({len(losses)} steps)")


if __name__ == "__main__":
    main()
