"""The GPU benchmark (docs/gpu.md): ``build_bundle`` compiles steps here into a bundle
(evaluate/gpu_bundle.py); ``bench`` runs it on the machine with the GPU, against PyTorch on the
same GPU, in one run (`pock gpu bundle`, `pock gpu bench`):

- parity: ``PARITY_STEPS`` steps of each case's parity build against PyTorch doing the identical
  update (evaluate/parity.py), TF32 off on both sides (fp32 is fp32);
- speed: the speed build timed interleaved with its peers (evaluate/speed.py, each in its own
  process): PyTorch eager full backpropagation, and for a sparse case eager with the same
  parameters frozen (and PEFT for a LoRA case), for a full one ``torch.compile``; ms per step,
  examples or tokens per second, the GPU memory each holds above its CUDA context, GFLOP/s
  against cuBLAS's float32 matrix product measured in the same run;
- runners (``runner_steps`` > 0): the speed build fine-tuned by the native runner (C++, TVM's
  runtime library only: what a device ships) and by the Python runner, the same steps on the
  same seeded batches: their weights compared, their step times and memory.

A step built for the CPU runs the same way on the CPU (how the tests check this module).
"""
from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from pipelines.evaluate.gpu_bundle import CASES, RUNNER, initial_values, seeded_batches
from pipelines.io import load_tensors, read_json, save_arrays
from pipelines.schema import ConfigError

PARITY_STEPS = 3


def machine(device: str) -> dict:
    """What ran it: the GPU's name and memory, the driver, PyTorch."""
    import torch

    if device != "cuda":
        return {"device": "cpu", "processor": platform.processor(), "torch": torch.__version__}
    properties = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu": properties.name,
            "gpu_memory_bytes": properties.total_memory,
            "multiprocessors": properties.multi_processor_count,
            "cuda": torch.version.cuda, "torch": torch.__version__}


def peers_of(case: dict, signature: dict) -> list[str]:
    """Full backpropagation in PyTorch for every case; a sparse case's own PyTorch (frozen),
    a full case's compiled PyTorch; a LoRA case's PEFT."""
    if case["scheme"] == "full":
        return ["torch_eager_full", "torch_compile_full"]
    lora = signature.get("lora") is not None
    return ["torch_eager_full", "torch_eager_frozen", *(["peft_lora"] if lora else [])]


def bench_case(bundle: Path, case: dict, timing: dict, device: str, scratch: Path,
               result: dict, done=None) -> None:
    """One case into ``result``: its parity build against PyTorch, then its speed build beside
    the peers; either one that fails is recorded with its error, and the other still runs.
    ``scratch``: a directory for the batch the speed processes read. ``done()`` after each."""
    result["scheme"] = case["scheme"]
    roles = [("parity", _parity), ("speed", _speed)]
    if timing.get("runner_steps"):
        roles.append(("runners", _runners))
    for role, run in roles:
        start = time.perf_counter()
        try:
            result[role] = run(bundle, case, timing, device, scratch)
        except Exception as err:  # noqa: BLE001 - recorded: the table says why
            import traceback

            traceback.print_exc()
            result[role] = {"error": f"{type(err).__name__}: {err}"}
        result[role]["seconds"] = time.perf_counter() - start
        print(f"  {role}: {result[role]['seconds']:.1f} s", flush=True)
        if done is not None:
            done()


def _loaded(bundle: Path, case: dict, role: str):
    from pydantic import TypeAdapter

    from pipelines.config import Model, Optimizer

    build = bundle / case["builds"][role]
    model = TypeAdapter(Model).validate_python(case["models"][role])
    signature = read_json(build / "signature.json")
    initial = initial_values(build, model, signature, case["seed"])
    optimizer = TypeAdapter(Optimizer).validate_python(case["optimizer"])
    return (build, model, optimizer, signature, initial,
            seeded_batches(signature, case["seed"], PARITY_STEPS))


def _parity(bundle: Path, case: dict, timing: dict, device: str, scratch: Path) -> dict:
    from pipelines.evaluate.parity import compare_steps

    build, model, optimizer, _, initial, batches = _loaded(bundle, case, "parity")
    return {**compare_steps(build, model, optimizer, initial, batches, device,
                            chained=case["parity_chained"]), "layers": case["parity_layers"]}


def _speed(bundle: Path, case: dict, timing: dict, device: str, scratch: Path) -> dict:
    from pipelines.evaluate.speed import Spec, measure

    build, model, optimizer, signature, initial, batches = _loaded(bundle, case, "speed")
    batch = scratch / "batch.npz"
    save_arrays(batch, dict(zip(signature["data"], batches[0])))
    spec = Spec(cores=timing["cores"], warmup=timing["warmup"], steps=timing["steps"],
                batch=batch, build=build, initial=initial, model=model, optimizer=optimizer,
                rounds=timing["rounds"], min_seconds=timing["min_seconds"], device=device)
    speed = measure(spec, timing.get("peers") or peers_of(case, signature), case["report"])
    return {**speed, "planned_peak_bytes": read_json(build / "plan.json")["planned_peak_bytes"]}


def _runners(bundle: Path, case: dict, timing: dict, device: str, scratch: Path) -> dict:
    """The speed build fine-tuned by the bundle's native runner and by the Python runner,
    each in its own process, ``timing["runner_steps"]`` steps on the same seeded batches:
    whether their weights are equal, and each one's median ms per step after the first 3, its
    peak resident memory and on a GPU the device memory it held."""
    from pipelines.runtime import native

    runner = bundle / RUNNER / "runner"
    if not runner.exists():
        raise FileNotFoundError(f"{runner}: the bundle holds no native runner")
    build, _, _, signature, initial, _ = _loaded(bundle, case, "speed")
    steps = timing["runner_steps"]
    step_dir = native.step_directory(build, initial, scratch / "step")
    data = scratch / "data"
    data.mkdir()
    batches = seeded_batches(signature, case["seed"] + 1, steps)
    native.save_data(data / "train.safetensors", signature,
                     tuple(np.concatenate(arrays) for arrays in zip(*batches)))
    if device == "cuda":  # the CUDA runtime PyTorch loaded, for TVM's CUDA runtime to find
        _put_cuda_runtime_on_library_path()
    logs, weights = {}, {}
    for name in ("native", "python"):
        out = scratch / name
        out.mkdir()
        args = ("--steps", str(steps))
        logs[name] = (native.run_native(runner, step_dir, data, out, args=args,
                                        cores=timing["cores"])
                      if name == "native" else
                      native.run_python(step_dir, data, out, timing["cores"], args=args))
        weights[name] = load_tensors(out / "weights.safetensors")
    got, want = weights["native"], weights["python"]
    same_names = sorted(got) == sorted(want)
    result = {"steps": steps, "device": logs["native"].get("device"),
              "losses_equal": np.array_equal(*(np.float32(log["losses"]) for log in logs.values())),
              "weights_bit_identical": same_names and all(
                  np.array_equal(got[n], want[n]) for n in want),
              "weights_max_abs_difference": max(
                  float(np.max(np.abs(got[n].astype("float64") - want[n]), initial=0))
                  for n in want) if same_names else None}
    for name, log in logs.items():
        result[name] = {"ms_per_step": float(np.median(log["step_ms"][3:] or log["step_ms"])),
                        "peak_rss_bytes": log["peak_rss_bytes"],
                        "device_held_bytes": log.get("device_held_bytes"),
                        "first_loss": log["losses"][0], "last_loss": log["losses"][-1]}
    result["native_speedup_vs_python"] = (result["python"]["ms_per_step"]
                                          / result["native"]["ms_per_step"])
    return result


def _put_cuda_runtime_on_library_path() -> None:
    """The directories of the CUDA runtime (libcudart) and cuBLAS this process loaded, first
    on LD_LIBRARY_PATH for the runners it starts: a GPU host's CUDA libraries are often
    PyTorch's own (pip packages), which the system's loader does not know."""
    import os

    import torch

    torch.zeros(1, device="cuda")  # loads them
    maps = Path("/proc/self/maps").read_text().split()
    found = sorted({str(Path(p).parent) for p in maps
                    if Path(p).name.startswith(("libcudart.so", "libcublas.so"))})
    if found:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
            [*found, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])


def build_bundle(out: Path, overrides: list[str], profile_name: str = "nvidia_hopper",
                 python: str = "3.12", parity_layers: int = 2,
                 unchained: tuple[str, ...] = ("mbv2",), runtime: bool = True) -> dict:
    """``experiment=gpu``'s cases (with Hydra ``overrides``) compiled through the one chain
    for ``profile_name`` into the bundle ``out`` (evaluate/gpu_bundle.py: a speed build, a
    parity build of a transformers model's first ``parity_layers`` layers; the steps of
    ``unchained`` models each checked from the initial state), the native runner, and TVM's
    runtime and the wheels for CPython ``python`` unless not ``runtime``; replaced in one
    rename. Its cases."""
    import yaml

    from pipelines.compile import compile, import_and_lower
    from pipelines.compose import compose_text
    from pipelines.config import case_optimizer, validate
    from pipelines.evaluate import gpu_bundle
    from pipelines.io import atomic_dir, write_json_atomic
    from pipelines.profiles import load_profile
    from pipelines.runtime.native import build_runner

    params = validate(yaml.safe_load(compose_text(["experiment=gpu", *overrides])))
    profile = load_profile(profile_name, params.profiles)
    lowered, cases = {}, {}
    with atomic_dir(out) as bundle:
        for name, spec in params.cases.items():
            model, scheme = params.models[spec.model], params.schemes[spec.scheme]
            optimizer = case_optimizer(params, spec)
            small = gpu_bundle.parity_model(model, parity_layers)
            builds, models, report = {}, {}, None
            for role, section in (("speed", model), ("parity", small)):
                if section is None:  # small already: its speed build is checked
                    builds[role], models[role] = builds["speed"], models["speed"]
                    continue
                if (spec.model, role) not in lowered:
                    lowered[spec.model, role] = import_and_lower(section, seed=params.seed)
                directory = bundle / "cases" / name / role
                print(f"gpu bundle: {name} ({role}) for {profile.name}", flush=True)
                built = compile(section, scheme.rules, optimizer, profile, directory,
                                lora=scheme.lora, scheme_name=spec.scheme,
                                statistics=scheme.statistics,
                                lowered=lowered[spec.model, role], seed=params.seed)
                gpu_bundle.save_extra(directory, section, built.signature, built.initial,
                                      params.seed)
                builds[role] = str(directory.relative_to(bundle))
                models[role] = section.model_dump(mode="json")
                report = report or built.report  # the speed build's: its FLOPs
            cases[name] = {"scheme": spec.scheme, "seed": params.seed,
                           "optimizer": optimizer.model_dump(mode="json"),
                           "parity_layers": None if small is None else parity_layers,
                           "parity_chained": spec.model not in unchained,
                           "report": report, "builds": builds, "models": models}
        write_json_atomic(bundle / CASES, cases)
        build_runner(profile, bundle / RUNNER)
        if runtime:
            gpu_bundle.copy_runtime(bundle)
            gpu_bundle.download_wheels(bundle, python)
    return cases


def _fp32_only() -> None:
    """fp32 against fp32: PyTorch would otherwise run its convolutions in TF32 on Ampere and
    later."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _case_process(bundle: Path, case: dict, timing: dict, device: str, scratch: Path,
                  queue) -> None:
    import faulthandler
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"  # a GPU host may reach no network: never wait on one
    # a case about to be stopped says where it stands (which call has not returned)
    faulthandler.dump_traceback_later(max(1.0, timing["case_seconds"] - 5), exit=False)
    _fp32_only()
    result = {}
    bench_case(bundle, case, timing, device, scratch, result, lambda: queue.put(dict(result)))


def run_case(bundle: Path, case: dict, timing: dict, device: str, seconds: float, done) -> dict:
    """``bench_case`` in a process of its own, stopped after ``seconds``: a case that hangs or
    crashes is recorded as such (with what it finished), and the next case runs."""
    import multiprocessing
    import queue as queues

    context = multiprocessing.get_context("spawn")
    channel = context.Queue()
    # made and removed here: a case stopped by force leaves nothing behind
    scratch = Path(tempfile.mkdtemp(prefix="pock-gpu-"))
    worker = context.Process(target=_case_process,
                             args=(bundle, case, timing, device, scratch, channel))
    worker.start()
    result, deadline = {"scheme": case["scheme"]}, time.monotonic() + seconds
    roles = ("parity", "speed", *(("runners",) if timing.get("runner_steps") else ()))
    while True:
        try:
            result = channel.get(timeout=1.0)
            done(result)
            if roles[-1] in result:
                break
        except queues.Empty:
            if not worker.is_alive() or time.monotonic() > deadline:
                stopped = "timed out" if worker.is_alive() else f"exit {worker.exitcode}"
                for role in roles:
                    result.setdefault(role, {"error": f"{stopped} after {seconds:g} s"
                                             if stopped == "timed out" else stopped})
                break
    worker.kill()
    worker.join()
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def bench(bundle: Path, timing: dict, only: list[str] | None = None, done=None) -> dict:
    """Every case of the bundle (or ``only`` these, in that order), each in its own process
    for at most ``timing["case_seconds"]``: parity, then speed; ``done(results)`` as each
    phase ends (a run cut short keeps what it finished)."""
    import torch

    cases = read_json(bundle / CASES)
    unknown = sorted(set(only or []) - set(cases))
    if unknown:
        raise ConfigError(f"{bundle / CASES}: no case {unknown}; its cases: {sorted(cases)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"machine": machine(device)}

    def finished(name: str, result: dict) -> None:
        results[name] = result
        if done is not None:
            done(results)

    for name in only or cases:
        print(f"gpu bench: {name}", flush=True)
        result = run_case(bundle, cases[name], timing, device, timing["case_seconds"],
                          lambda result, name=name: finished(name, result))
        finished(name, result)
        print(summary(name, result), flush=True)
    return results


def summary(name: str, result: dict) -> str:
    parity, speed = result["parity"], result["speed"]
    said = [f"parity FAILED ({parity['error']})" if "error" in parity else
            f"parity {'ok' if parity['matches'] else 'DIFFERS'} (losses "
            f"{parity['loss_max_relative_error']:.1e} rel, tensors "
            f"{parity['worst_diff_over_tolerance']:.2g}x tolerance)"]
    if "error" in speed:
        said.append(f"speed FAILED ({speed['error']})")
    else:
        said.append(f"{speed['compiled']['median_ms']:.2f} ms/step")
        said += [f"{k.removeprefix('speedup_vs_')} {v:.2f}x" for k, v in speed.items()
                 if k.startswith("speedup_vs_")]
    runners = result.get("runners")
    if runners and "error" in runners:
        said.append(f"runners FAILED ({runners['error']})")
    elif runners:
        said.append(f"native runner {runners['native']['ms_per_step']:.2f} ms/step "
                    f"({runners['native_speedup_vs_python']:.2f}x the Python runner), weights "
                    f"{'bit-identical' if runners['weights_bit_identical'] else 'DIFFER'}")
    return f"{name}: " + "; ".join(said)
