"""One benchmark case per fresh process: the compiled step, PyTorch eager with full
backpropagation, PyTorch eager with the scheme's frozen layers frozen, and `torch.compile`d full
backpropagation — same shapes, same batch, same thread count. Each returns step times (ms) and
peak memory above its baseline. ``sgemm_peak`` measures what the machine's BLAS reaches, the
yardstick for GFLOP/s."""
from __future__ import annotations

import os
import time

import numpy as np

from pipelines.timing import step_times


def first_batch(data_path: str, batch: int):
    with np.load(data_path) as data:
        return (np.ascontiguousarray(data["finetune_train_x"][:batch]),
                np.ascontiguousarray(data["finetune_train_y"][:batch]))


def run_case(case: str, spec: dict) -> dict:
    os.environ["TVM_NUM_THREADS"] = str(spec["cores"])
    import torch

    from pipelines.memory import PeakRSS

    torch.set_num_threads(spec["cores"])
    if "batch_file" in spec:  # a batch of its own (the workloads stage's tokens): x and y
        with np.load(spec["batch_file"]) as batch:
            x, y = batch["x"], batch["y"]
    else:
        x, y = first_batch(spec["data"], spec["batch"])
    warmup, steps = spec["warmup"], spec["steps"]
    if case == "compiled":
        from pipelines.step import CompiledStep, load_initial

        compiled = CompiledStep(spec["build_dir"], load_initial(spec["initial"]))
        args = compiled.arguments(x, y)

        def step():  # the state passed in is not mutated: every call times the same step
            compiled.function(*args)
    else:
        from pipelines.models import build_model
        from pipelines.torch_ref import make_optimizer, train_step

        model = build_model(spec["model"]).train()
        model.load_state_dict(torch.load(spec["weights"], weights_only=True))
        if spec.get("lora"):  # a LoRA scheme: PyTorch with the same seeded adapters
            from pipelines.lora import add_adapters
            add_adapters(model, spec["lora"], spec["seed"])
        trainable = spec["trainable"] if case == "torch_eager_frozen" else None
        opt = make_optimizer(model, spec["optimizer"], trainable)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        # torch.compile: forward and backward compiled (Inductor, C++ on the CPU), the update
        # eager; compiling happens in the first warm-up step, outside the timed ones.
        net = torch.compile(model) if case == "torch_compile_full" else model

        def step():
            train_step(net, opt, tx, ty)

    # The same wall-clock loop for every case; the peak counts from before the first step,
    # because warm-up allocates too.
    with PeakRSS() as peak:
        times = step_times(step, warmup, steps)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "peak_rss_bytes": peak.above_baseline_bytes, "steps": len(times)}


def sgemm_peak(cores: int, size: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of a float32 matrix product on ``cores`` threads (numpy's OpenBLAS): what this
    machine's tuned BLAS reaches, the ceiling a training step's GFLOP/s is read against."""
    from threadpoolctl import threadpool_limits  # numpy is loaded already: limit its BLAS

    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    times = []
    with threadpool_limits(limits=cores, user_api="blas"):
        a @ a
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - start)
    return 2 * size**3 / float(np.median(times)) / 1e9
