"""artifacts/report.md from the committed metrics (artifacts/metrics/): per model, every case on
the host next to PyTorch doing the same update in the same run; what the deploy cases' schemes
remove, their memory plans, where their time goes; every device they were built for; the
scheme searches and the fine-tuning runs."""
from __future__ import annotations

import json
from pathlib import Path

from pipelines.io import read_json
from pipelines.report.first_step import PHASES, first_step_table, phase_key

PEERS = {"torch_eager_full": "eager full", "torch_eager_frozen": "eager frozen",
         "torch_compile_full": "torch.compile", "peft_lora": "PEFT LoRA"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}x"


def load(metrics: Path, cases: dict, deploy: list, devices: list, packages: list,
         profiled: list) -> dict:
    """Every metrics file the report reads, by stage and name (absent ones are None)."""
    def get(stage: str, name: str):
        path = metrics / stage / f"{name}.json"
        return read_json(path) if path.exists() else None

    return {
        "evaluate": {c: get("evaluate", c) for c in cases},
        "prune": {c: get("prune", c) for c in cases},
        "optimize": {c: get("optimize", c) for c in cases},
        "build": {f"{c}-{d}": get("build", f"{c}-{d}") for c in cases
                  for d in ["host", *(devices if c in deploy else [])]},
        "benchmark": {f"{c}-{d}": get("benchmark", f"{c}-{d}") for c in deploy for d in devices},
        "package": {f"{c}-{d}": get("package", f"{c}-{d}") for c in deploy for d in packages},
        "profile": {c: get("profile", c) for c in profiled},
        "curves": {c: (get("curves", f"{c}-loss"), get("curves", f"{c}-eval"))
                   for c in cases},
        "time": {phase: {key: get(f"time/{phase}", key) for key in
                         {phase_key(phase, c, case["model"]) for c, case in cases.items()}}
                 for phase in PHASES},
        # `pock gpu bench` runs, committed per GPU (docs/gpu.md)
        "gpu": {p.stem: read_json(p) for p in sorted((metrics / "gpu").glob("*.json"))},
    }


def _over_runs(tuned: dict, key: str) -> str:
    """A fine-tuning score: the runs' mean and standard deviation where it ran more than once
    (finetune.runs), else the one run's."""
    runs = tuned.get("runs")
    if runs is None:
        return f"{tuned[key]:.3f}"
    return f"{runs[key + '_mean']:.3f} ± {runs[key + '_std']:.3f}"


def case_table(model: str, names: list[str], cases: dict, found: dict) -> list[str]:
    lines = [f"## {model}: its cases on the host, compiled vs PyTorch (same run)", "",
             "| case | scheme | optimize | trainable | backward FLOPs vs full | ms/step | per s | "
             + "".join(f"vs {peer} | " for peer in PEERS.values())
             + "peak memory vs eager full | planned peak "
             "| held-out accuracy (or perplexity, or loss): before, compiled, PyTorch "
             "(mean ± std where fine-tuned several times) |",
             "|---" * (10 + len(PEERS)) + "|"]
    for name in names:
        row, case = found["evaluate"][name], cases[name]
        if row is None:
            continue
        speed, tuned = row.get("speed"), row.get("finetune")
        optimize = case.get("optimize") or {}
        variant = ", ".join(f"{k}={v}" for k, v in optimize.items()
                            if v is not None) or "default"
        if speed:
            compiled = speed["compiled"]
            unit = "tokens" if "tokens_per_s" in compiled else "examples"
            timing = (f"{compiled['median_ms']:.2f} | {compiled[f'{unit}_per_s']:.0f} {unit} | "
                      + " | ".join(_x(speed.get(f"speedup_vs_{p}")) for p in PEERS) + " | "
                      + _x(speed.get("memory_vs_torch_eager_full")))
        else:
            timing = " | " * (len(PEERS) + 2)
        # a classifier's accuracy, a language model's perplexity, else the held-out loss
        metric = next((m for m in ("accuracy", "perplexity", "held_out_loss")
                       if tuned and f"{m}_before" in tuned), None)
        accuracy = (f"{tuned[f'{metric}_before']:.3f}, "
                    + ", ".join(_over_runs(tuned, f"{metric}_{side}")
                                for side in ("compiled", "pytorch"))
                    + {"accuracy": "", "perplexity": " (perplexity)"}.get(metric, " (loss)")
                    + (f" ({len(tuned['runs']['seeds'])} runs)" if "runs" in tuned else "")
                    if metric else "")
        cost = row["cost"]
        lines.append(f"| {name} | {case['scheme']} | {variant} | {cost['trainable_fraction']:.2%} "
                     f"| {cost['backward_flops_vs_full']:.3f} | {timing} | "
                     f"{_mib(row['plan']['planned_peak_bytes'])} | {accuracy} |")
    not_timed = [f"- {name}, {peer}: {reason}" for name in names
                 for peer, reason in ((found["evaluate"][name] or {}).get("speed") or {})
                 .get("not_timed", {}).items()]
    return lines + ["", "Speedups are each peer's median step time over the compiled step's, "
                    "each case in a fresh process on the host's cores; a peer that is not "
                    "PyTorch is timed only once its first losses are PyTorch's doing the same "
                    "update. A blank: the peer did not time the case, for the reason listed "
                    "below. Peak memory is each process's resident memory at its peak "
                    "above what it held before the case was set up: weights, optimizer state, "
                    "activations.", "",
                    *(["Not timed:", "", *not_timed, ""] if not_timed else []),
                    *openblas_lines(names, found)]


def _kernels(blas: dict) -> str:
    """"SkylakeX, OpenBLAS's choice for this CPU" or "Haswell, forced by OPENBLAS_CORETYPE=..."."""
    return blas["core"] + (f", forced by OPENBLAS_CORETYPE={blas['forced']}" if blas["forced"]
                           else ", OpenBLAS's choice for this CPU")


def openblas_lines(names: list[str], found: dict) -> list[str]:
    """Which OpenBLAS kernels each case's products ran, beside the run's sgemm peak: the
    same code is up to twice as fast on a CPU's own kernels as on an older core's, which some
    environments force (OPENBLAS_CORETYPE)."""
    runs = []
    for name in names:
        speed = (found["evaluate"][name] or {}).get("speed") or {}
        if blas := speed.get("openblas"):
            runs.append(f"{name}: {_kernels(blas)} "
                        f"(sgemm peak {speed['sgemm_peak_gflop_per_s']:.0f} GFLOP/s)")
    return ["OpenBLAS's kernels in each run: " + "; ".join(runs) + ".", ""] if runs else []


def timed_peers(names: list[str], found: dict) -> list[str]:
    """Every peer that timed one of the cases ``names`` (in their metrics' order)."""
    peers: dict[str, None] = {}
    for name in names:
        speed = (found["evaluate"][name] or {}).get("speed") or {}
        peers.update((key, None) for key, value in speed.items()
                     if key != "compiled" and isinstance(value, dict) and "median_ms" in value)
    return list(peers)


def peer_table(model: str, names: list[str], found: dict) -> list[str]:
    """Each case of ``model`` beside every peer that timed it, in the same run: the peer's
    step time, the compiled step's speed over it, and its peak memory."""
    peers = timed_peers(names, found)
    if not peers:
        return []
    lines = [f"### {model}: every peer, same run (ms/step, compiled's speedup, peak memory)", "",
             f"![{model}: the compiled step's speedup over each peer](plots/peers-{model}.svg)",
             "", "| case | compiled | " + " | ".join(peers) + " |",
             "|---|---|" + "---|" * len(peers)]
    for name in names:
        speed = (found["evaluate"][name] or {}).get("speed")
        if not speed:
            continue
        compiled = speed["compiled"]
        cells = [f"{speed[p]['median_ms']:.2f} ms ({_x(speed.get(f'speedup_vs_{p}'))}, "
                 f"{_mib(speed[p]['peak_rss_bytes'])})" if p in speed else "" for p in peers]
        lines.append(f"| {name} | {compiled['median_ms']:.2f} ms "
                     f"({_mib(compiled['peak_rss_bytes'])}) | " + " | ".join(cells) + " |")
    return lines + ["", "Every peer that is not PyTorch agreed with PyTorch doing the same "
                    "update on its first losses before it was timed (`speed.<peer>.first_"
                    "losses` in the metrics); a blank: not timed, for the reason listed above.",
                    ""]


def sparse_tables(name: str, report: dict, plan: dict) -> list[str]:
    lines = [f"## {name}: what the scheme `{report['scheme']}` removes from full "
             "backpropagation", "", "| | full BP | pruned | removed |", "|---|---|---|---|"]
    for key in ("ops", "flops", "backward_flops", "bytes_produced", "trainable_elements",
                "param_grad_bytes", "optimizer_state_bytes", "saved_activation_bytes"):
        lines.append(f"| {key} | {report['full'][key]:,} | {report['pruned'][key]:,} | "
                     f"{report['removed_fraction'][key]:.1%} |")
    if report["channel_sparse"]:
        lines += ["", "Channel-sparse parameters (only these channels' gradient is computed):",
                  "", "| parameter | axis | channels | gradient slice computed from |",
                  "|---|---|---|---|"]
        lines += [f"| {p} | {'output' if c['axis'] == 0 else 'input'} | {c['channels']} | "
                  f"{'sliced operands' if c['gradient'] == 'operands' else c['gradient']} |"
                  for p, c in report["channel_sparse"].items()]
    lines += ["", f"Planned peak (TVM's static memory plan, updates reordered: "
              f"{plan['reorder_updates']}): {_mib(plan['planned_peak_bytes'])} = inputs "
              f"{_mib(plan['inputs_bytes'])} + planned intermediates "
              f"{_mib(plan['planned_storage_bytes'])} + outputs {_mib(plan['outputs_bytes'])}"
              + (f"; recomputing cheap activations instead: "
                 f"{_mib(plan['recompute']['planned_peak_bytes'])}" if plan.get("recompute")
                 else "")
              + (f"; {plan['stored_narrower']} frozen weights stored as {plan['frozen_dtype']}"
                 + (f" ({', '.join(plan['kept_float32'])} kept float32: a product's copy of it "
                    "cost more at the peak)" if plan["kept_float32"] else "")
                 if plan.get("stored_narrower") else "") + ".", "",
              "| inputs: weights | buffers | optimizer state | batch | alive at the peak: "
              "activations for backward | backward workspace | gradients and updates | new "
              "values |", "|---|---|---|---|---|---|---|---|",
              "| " + " | ".join(_mib(plan["inputs"][k]) for k in
                               ("weights", "buffers", "optimizer_state", "batch")) + " | "
              + " | ".join(_mib(v) for v in plan["liveness"]["at_peak"].values()) + " |", ""]
    return lines


def search_table(name: str, table: dict) -> list[str]:
    rows = sorted(table["candidates"], key=lambda r: -r["contribution"])[:8]
    return [f"## {name}: the scheme search (budget {table['budget_mb']:g} MiB)", "",
            f"Loss drop per byte, measured by short PyTorch fine-tuning runs; gradients + "
            f"state + saved activations of the chosen scheme "
            f"{table['chosen_cost_bytes'] / 2**20:.3f} MiB; base mean training loss "
            f"{table['base_loss']:.4f}. Best candidates:", "",
            "| layer | channel ratio | loss drop | memory cost | chosen |", "|---|---|---|---|---|",
            *[f"| {r['module']} | {r['ratio']:g} | {r['contribution']:+.4f} | "
              f"{r['cost_bytes'] / 2**10:.1f} KiB | {'yes' if r['chosen'] else ''} |"
              for r in rows], ""]


def kernel_profile(name: str, profile: dict) -> list[str]:
    def share(table: dict) -> str:
        return ", ".join(f"{k} {v['ms_per_step']:.2f} ms ({v['share']:.0%})"
                         for k, v in table.items())

    lines = [f"## {name}: where the time goes (host build, kernel by kernel)", "",
             f"{profile['calls_per_step']} VM calls per step take {profile['kernel_time_ms']:.2f} "
             f"ms, each call's median over the steps (the plain step: "
             f"{profile['plain_step_ms']:.2f} ms). The native runner times each call in C++, "
             f"which adds about {profile['instrument_us_per_call']:.2f} µs per call.", "",
             f"- by phase: {share(profile['phases'])}",
             f"- by kind: {share(profile['kinds'])}", "",
             "| kernel | phase | kind | calls/step | ms/step | share |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r['kernel']}` | {r['phase']} | {r['kind']} | {r['calls_per_step']} | "
              f"{r['ms_per_step']:.3f} | {r['share']:.1%} |" for r in profile["top_kernels"]]
    return lines + [""] + product_lines(profile.get("products"))


def product_lines(products: dict | None) -> list[str]:
    """The step's matrix products (profile@): their GFLOP/s, in all and per function, against
    the sgemm peak measured beside them; nothing for a profile without them."""
    if not products or not products["calls_per_step"]:
        return []
    peak = products.get("sgemm_peak_gflop_per_s")

    def rate(r: dict) -> str:
        of_peak = f" ({r['gflop_per_s'] / peak:.0%} of the peak)" if peak else ""
        return f"{r['gflop_per_s']:.0f} GFLOP/s{of_peak}"

    def measured(r: dict) -> str:
        if "sgemm_peak_before_after" not in r:
            return ""
        before, after = r["sgemm_peak_before_after"]
        return f" (the higher of {before:.0f} before the profile and {after:.0f} after)"

    kernels = products.get("openblas")
    blas = f"; OpenBLAS's kernels: {_kernels(kernels)}" if kernels else ""
    lines = [f"Its matrix products: {products['calls_per_step']} calls a step, "
             f"{products['gflop_per_step']:.2f} GFLOP in {products['ms_per_step']:.2f} ms, "
             f"{rate(products)}" + (f", against the sgemm peak of {peak:.0f} GFLOP/s on the "
                                    f"host's cores{measured(products)}{blas}" if peak else "")
             + ":", "", "| function | calls/step | GFLOP/step | ms/step | GFLOP/s |",
             "|---|---|---|---|---|"]
    lines += [f"| `{name}` | {r['calls_per_step']} | {r['gflop_per_step']:.2f} | "
              f"{r['ms_per_step']:.2f} | {rate(r)} |" for name, r in products["functions"].items()]
    return lines + [""]


def _target_name(target: str) -> str:
    """"llvm cortex-a72", "cuda sm_87": the kind and the CPU or GPU it is built for, from the
    target the build records (TVM writes it as JSON)."""
    try:
        fields = json.loads(target)
    except ValueError:
        return target  # an older build's "llvm -mcpu=..." string
    chip = fields.get("mcpu") or fields.get("arch") or fields.get("mtriple", "")
    return f"{fields.get('kind', '')} {chip}".strip()


def _container_peers_table(benchmarks: dict) -> list[str]:
    """Peers training the same case in the device's container after the compiled step
    (evaluate/container_peers.py): does the tool a user would pick instead fit?"""
    rows = [(key, peer, r, bench) for key, bench in benchmarks.items() if bench
            for peer, r in bench.get("peers", {}).items()]
    if not rows:
        return []
    lines = ["", "Peers in the same container, after the compiled step (PyTorch's and PEFT's "
             "twin from the same values, exported with its loss; TensorFlow's step saved, "
             "TFLite's model converted, ONNX Runtime's training artifacts and ExecuTorch's "
             "program made here; the same "
             "optimizer and trainable set as on the host). The compiled step's figures "
             "beside them are the native runner's (what a package ships, no Python), each "
             "a whole process:", "",
             "| case | device | peer | verdict | peak memory | first loss vs the host build | "
             "step latency | compiled step vs it |", "|---|---|---|---|---|---|---|---|"]
    for key, peer, r, bench in rows:
        case, device = key.rsplit("-", 1)
        if r["verdict"] == "ok":
            ratio = (f"{bench[f'speedup_vs_{peer}']:.2f}x the speed, "
                     f"{bench[f'memory_vs_{peer}']:.2f}x the memory"
                     if f"speedup_vs_{peer}" in bench else "")
            cells = [_mib(r["peak_rss_bytes"]),
                     f"{'matches' if r['matches_host'] else 'DOES NOT MATCH'} ({r['loss']:.6f} "
                     f"vs {r['loss_host']:.6f})",
                     f"{r['container']['median_ms']:.2f} ms in a container", ratio]
        elif r["verdict"] == "out_of_memory":
            cells = [f"over {r['memory_mb']:.0f} MiB", "", "out of memory", ""]
        else:
            cells = ["", "", r["reason"], ""]
        lines.append(f"| {case} | {device} | {peer} | {r['verdict']} | " + " | ".join(cells)
                     + " |")
    return lines


def device_table(found: dict) -> list[str]:
    lines = ["## Devices", "", "| case | device | target | built | ran | matches the host "
             "build | step latency | peak memory |", "|---|---|---|---|---|---|---|---|"]
    for key, bench in found["benchmark"].items():
        built = found["build"].get(key)
        if bench is None or built is None:
            continue
        taken = built.get("kernel_schedules") or {}
        tuned = taken.get("tuned", 0) + taken.get("anchor", 0)
        what = (f"{built['library']}, {_mib(built['library_bytes'])}"
                + (" (objects the device links)" if built["links_on_device"] else "")
                + (f"; {tuned} kernels tuned" if tuned else ""))
        # the process's peak resident memory on the device (under qemu: qemu's included)
        peak = _mib(bench["peak_rss_bytes"]) if "peak_rss_bytes" in bench else ""
        native = bench.get("native", {})
        if not bench["ran"]:
            ran, matches, latency = f"not run ({bench['runner']})", "", ""
        elif bench["verdict"] == "out_of_memory":
            ran, matches, latency = bench["runner"], "", "out of memory"
            peak = f"over {bench['memory_mb']:.0f} MiB"
        else:
            ran = bench["runner"]
            matches = (f"{'yes' if bench['matches_host'] else 'NO'} (loss {bench['loss']:.6f} "
                       f"vs {bench['loss_host']:.6f})")
            latency = (f"{bench['emulated']['median_ms']:.1f} ms emulated (qemu, not the "
                       "device's speed)" if "emulated" in bench
                       else f"{bench['container']['median_ms']:.2f} ms in a container (this "
                       "machine's cores)" if "container" in bench
                       else f"{bench['compiled']['median_ms']:.2f} ms")
            if native.get("verdict") == "ok":  # the Python runner checked it; what ships
                latency += f"; native runner {native['median_ms']:.2f} ms"
                peak += f" (native runner {_mib(native['peak_rss_bytes'])})"
            elif native:
                peak += f" (native runner {native['verdict'].replace('_', ' ')})"
        case, device = key.rsplit("-", 1)
        lines.append(f"| {case} | {device} | {_target_name(built['target'])} | {what} | {ran} "
                     f"| {matches} | {latency} | {peak} |")
    lines += _container_peers_table(found["benchmark"])
    packages = [(k, p) for k, p in found["package"].items() if p]
    if packages:
        lines += ["", "Packages: the native runner (no Python) in the image, tried within the "
                  "device's limits (emulated: under qemu, whose own memory counts), beside the "
                  "Python runner here on the same batches (runtime/package.py).", "",
                  "| package | image | trial | native runner | Python runner | agree |",
                  "|---|---|---|---|---|---|"]
        for key, metrics in packages:
            trial = metrics["trial"]
            if trial["verdict"] != "ok":
                lines.append(f"| {key} | `{metrics['image']}` | "
                             f"{trial.get('reason', trial['verdict'])} | | | |")
                continue
            native, python = trial["native"], trial["python"]
            runners = [f"{r['ms_per_step']:.2f} ms/step, peak {_mib(r['peak_rss_bytes'])}, "
                       f"image {_mib(r['image_bytes'])}" for r in (native, python)]
            agree = ("bit for bit" if trial["bit_identical"] else
                     f"to {trial['worst_diff_over_tolerance']:.2g}x tolerance")
            lines.append(f"| {key} | `{metrics['image']}` | {trial['steps']} steps, "
                         f"{trial['where']} | {runners[0]} | {runners[1]} | {agree} |")
    return lines + [""]


def _parity_cell(parity: dict) -> str:
    if "error" in parity:
        return f"failed: {parity['error']}"
    verdict = "ok" if parity["matches"] else (
        f"differs: tensors {parity['worst_diff_over_tolerance']:.3g}x tolerance")
    layers = f", first {parity['layers']} layers" if parity.get("layers") else ""
    return (f"{verdict} (losses {parity['loss_max_relative_error']:.1e} rel; "
            f"{parity['trained']} trained{layers})")


def _runners_cell(runners: dict | None) -> str:
    """The native runner beside the Python runner on the same steps (pipelines/gpu.py)."""
    if runners is None:
        return ""
    if "error" in runners:
        return f"failed: {runners['error']}"
    native, python = runners["native"], runners["python"]
    weights = ("same weights, bit for bit" if runners["weights_bit_identical"] else
               f"weights differ by up to {runners['weights_max_abs_difference']:.2g}")
    return (f"{native['ms_per_step']:.2f} ms ({runners['native_speedup_vs_python']:.2f}x the "
            f"Python runner), host memory {_mib(native['peak_rss_bytes'])} vs "
            f"{_mib(python['peak_rss_bytes'])}; {weights}")


def gpu_tables(runs: dict) -> list[str]:
    """Each GPU run: every case's parity on the GPU, its step beside the peers in the same
    run (ratios: how many times faster the compiled step is), the GPU memory held, and where
    the run had them the native runner beside the Python runner."""
    lines = []
    for stem, run in runs.items():
        machine = run["machine"]
        results = {name: result for name, result in run.items() if name != "machine"}
        runners = any("runners" in result for result in results.values())
        lines += [f"## On an NVIDIA GPU: {machine.get('gpu', machine['device'])} "
                  f"(`artifacts/metrics/gpu/{stem}.json`, docs/gpu.md)", ""]
        if any(f"speedup_vs_{p}" in r.get("speed", {}) for r in results.values() for p in PEERS):
            lines += [f"![speedups on the GPU](plots/gpu-{stem}.svg)", ""]
        lines += ["| case | parity vs PyTorch on the GPU | compiled | "
                  + " | ".join(PEERS.values()) + " | GPU memory vs eager full |"
                  + (" native runner |" if runners else ""),
                  "|---|---|---|" + "---|" * len(PEERS) + "---|" + ("---|" if runners else "")]
        for name, result in results.items():
            speed = result.get("speed", {})
            if "compiled" not in speed:
                cells = [f"failed: {speed.get('error', 'not run')}"] + [""] * len(PEERS) + [""]
            else:
                compiled = speed["compiled"]
                rate = (f", {compiled['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in compiled
                        else f", {compiled['examples_per_s']:,.0f} examples/s"
                        if "examples_per_s" in compiled else "")
                cells = [f"{compiled['median_ms']:.2f} ms{rate}"]
                cells += [f"{speed[p]['median_ms']:.2f} ms ({_x(speed.get(f'speedup_vs_{p}'))})"
                          if p in speed else "" for p in PEERS]
                cells.append(_x(speed.get("memory_vs_torch_eager_full")))
            if runners:
                cells.append(_runners_cell(result.get("runners")))
            lines.append(f"| {name} | {_parity_cell(result.get('parity', {'error': 'not run'}))}"
                         f" | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def cases_by_model(cases: dict) -> dict[str, list[str]]:
    """Each model's cases, in the config's order."""
    by_model: dict[str, list[str]] = {}
    for name, case in cases.items():
        by_model.setdefault(case["model"], []).append(name)
    return by_model


def render(found: dict, cases: dict, deploy: list) -> str:
    by_model = cases_by_model(cases)
    lines = ["# pockengine report", "",
             f"{len(cases)} cases compiled through the chain (params.yaml `cases`) and evaluated "
             f"on the host; deployed: {', '.join(deploy) or 'none'}.", "",
             "![step latency per case](plots/latency.svg)", "",
             "![training memory per case](plots/memory.svg)", ""]
    for model, names in by_model.items():
        lines += (case_table(model, names, cases, found) + peer_table(model, names, found)
                  + first_step_table(model, names, found))
    for name in deploy:
        if found["prune"][name] and found["optimize"][name]:
            lines += sparse_tables(name, found["prune"][name], found["optimize"][name])
        if found["curves"][name][0]:
            lines += [f"![{name}: fine-tuning loss and accuracy, compiled vs PyTorch]"
                      f"(plots/finetune-{name}.svg)", ""]
    for name, profile in found["profile"].items():
        if profile:
            lines += kernel_profile(name, profile)
    for name, report in found["prune"].items():
        if report and report.get("search"):
            lines += search_table(name, report["search"])
    return "\n".join(lines + device_table(found) + gpu_tables(found.get("gpu", {})))
