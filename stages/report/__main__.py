"""report: every metric in markdown tables, per device, next to PyTorch, with plots.

Outputs: artifacts/report.md, artifacts/plots/ (plot data for `dvc plots show` and the SVGs the
report embeds: stages/report/plots.py).
"""
from __future__ import annotations

import json

from pipelines.artifacts import ARTIFACTS, write_text_atomic
from pipelines.config import load_params, require, run_stage
from stages.report.plots import write_plots

PLOTS = ARTIFACTS / "plots"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def render(params: dict) -> str:
    prune = json.loads((ARTIFACTS / "prune" / "report.json").read_text())
    schemes = json.loads((ARTIFACTS / "schemes" / "metrics.json").read_text())
    search = json.loads((ARTIFACTS / "search" / "contributions.json").read_text())
    plan = json.loads((ARTIFACTS / "optimize" / "plan.json").read_text())
    tune = json.loads((ARTIFACTS / "finetune" / "metrics.json").read_text())
    memory = json.loads((ARTIFACTS / "memory" / "metrics.json").read_text())
    model = params["model"]
    lines = [
        f"# pockengine report: {model['name']} (width {model['width']}, batch "
        f"{model['batch_size']}, {model['image_size']}x{model['image_size']}), scheme "
        f"`{prune['scheme']}`",
        "",
        "## Step latency and memory (compiled vs PyTorch, same machine, same run)",
        "",
        "![step latency per device and scheme](plots/latency.svg)",
        "",
        "| device | case | median ms | p90 ms | peak RSS above baseline | speedup of compiled | "
        "GFLOP/s (of sgemm peak) |",
        "|---|---|---|---|---|---|---|",
    ]
    peaks = []
    for device in require(params, "devices"):
        bench = json.loads((ARTIFACTS / "benchmark" / f"{device}.json").read_text())
        if bench["runner"] != "local":  # PyTorch runs here only: see the device table below
            continue
        peaks.append(f"{device}: {bench['sgemm_peak_gflop_per_s']:.0f} GFLOP/s")
        compiled = bench["compiled"]["median_ms"]
        for case in ("compiled", "torch_eager_full", "torch_eager_frozen", "torch_compile_full"):
            row = bench[case]
            lines.append(f"| {device} | {case} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | "
                         f"{_mib(row['peak_rss_bytes'])} | {row['median_ms'] / compiled:.2f}x | "
                         f"{row['gflop_per_s']:.2f} ({row['fraction_of_sgemm_peak']:.1%}) |")
    lines += [
        "",
        "GFLOP/s: the FLOPs of the step each case computes (the sparse step for the compiled one "
        "and for PyTorch with frozen layers, full BP otherwise) over its median time; the peak "
        "is a float32 matrix product on the same cores with numpy's OpenBLAS "
        f"({'; '.join(peaks)}).",
        "",
        f"Planned peak of the compiled step (TVM's static memory plan, update reordering "
        f"{'on' if plan['reorder_updates'] else 'off'}): {_mib(plan['planned_peak_bytes'])}"
        f" = inputs {_mib(plan['inputs_bytes'])} + planned intermediates "
        f"{_mib(plan['planned_storage_bytes'])} + outputs {_mib(plan['outputs_bytes'])}"
        + (" (cheap activations recomputed)." if plan["recomputed"] else ".")
        + (f" Recomputing cheap activations instead (optimize.recompute=auto, taken by a "
           f"device whose budget needs it): {_mib(plan['recompute']['planned_peak_bytes'])}."
           if plan.get("recompute") else ""),
        "",
        "| inputs: weights | BN buffers | optimizer state | batch | alive at the liveness peak: "
        "activations for backward | backward workspace | gradients and updates | new values |",
        "|---|---|---|---|---|---|---|---|",
        "| " + " | ".join(_mib(plan["inputs"][k]) for k in
                         ("weights", "buffers", "optimizer_state", "batch")) + " | "
        + " | ".join(_mib(v) for v in plan["liveness"]["at_peak"].values()) + " |",
        "",
        "## Peak memory: full and sparse; plain, updates reordered, cheap activations "
        "recomputed (host)",
        "",
        "Each case in a fresh process, peak resident memory above its baseline "
        "(`artifacts/memory/metrics.json`). Kept for backward: the forward activations alive "
        "at the step's liveness peak.",
        "",
        "| case | peak RSS above baseline | planned peak (TVM) | kept for backward | median ms |",
        "|---|---|---|---|---|",
    ]
    for case, row in memory.items():
        if isinstance(row, dict):
            planned = kept = ""
            if "plan" in row:
                planned = _mib(row["plan"]["planned_peak_bytes"])
                kept = _mib(row["plan"]["liveness"]["at_peak"]["activations_for_backward"])
            lines.append(f"| {case} | {_mib(row['peak_rss_bytes'])} | {planned} | {kept} | "
                         f"{row['median_ms']:.2f} |")
    ratio = memory["sparse_compiled_vs_torch_full_peak"]
    lines += [
        "",
        f"Sparse compiled step / PyTorch eager full BP peak: "
        f"{'n/a' if ratio is None else f'{ratio:.3f}'}.",
        "",
        "## Sparse backpropagation (pruned vs full training graph)",
        "",
        "| | full BP | pruned | removed |",
        "|---|---|---|---|",
    ]
    for key in ("ops", "flops", "backward_flops", "bytes_produced", "trainable_elements",
                "param_grad_bytes", "optimizer_state_bytes", "saved_activation_bytes"):
        lines.append(f"| {key} | {prune['full'][key]:,} | {prune['pruned'][key]:,} | "
                     f"{prune['removed_fraction'][key]:.1%} |")
    lines.append("")
    if prune["channel_sparse"]:
        lines += ["Channel-sparse parameters (only these channels' gradient is computed):", "",
                  "| parameter | axis | channels | gradient slice computed from |", "|---|---|---|---|"]
        lines += [f"| {name} | {'output' if c['axis'] == 0 else 'input'} | {c['channels']} | "
                  f"{'sliced operands' if c['gradient'] == 'operands' else c['gradient']} |"
                  for name, c in prune["channel_sparse"].items()]
        lines.append("")
    lines += [
        "## Schemes side by side (host, compiled step)",
        "",
        "![training memory per scheme](plots/memory.svg)",
        "",
        f"PyTorch eager full BP in the same run: {schemes['torch_eager_full_ms']:.2f} ms/step "
        "(`artifacts/schemes/metrics.json`). Backward = backward pass plus updates.",
        "",
        "| scheme | ms/step | vs compiled full | vs PyTorch eager full | ops | FLOPs "
        "| backward FLOPs | parameter-gradient bytes | saved activations "
        "| accuracy after fine-tuning |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {name} | {row['median_ms']:.2f} | "
          f"{row['speedup_vs_compiled_full'] or float('nan'):.2f}x | "
          f"{row['speedup_vs_torch_eager_full']:.2f}x | {row['ops_vs_full']:.3f} | "
          f"{row['flops_vs_full']:.3f} | {row['backward_flops_vs_full']:.3f} | "
          f"{row['param_grad_bytes_vs_full']:.3f} | {row['saved_activation_bytes_vs_full']:.3f}"
          f" | {row['accuracy']:.3f} |"
          for name, row in ((n, schemes["schemes"][n]) for n in schemes["order"])],
        "",
        "Ratios in the op, FLOP and byte columns are the scheme's over full BP's.",
        "",
        f"## Scheme search (budget {search['budget_mb']:g} MiB)",
        "",
        f"`{schemes['order'][-1]}` above was chosen by `stages/search` "
        f"(`artifacts/search/scheme.yaml`): loss drop per byte, measured by short PyTorch "
        f"fine-tuning runs; gradients + state + saved activations "
        f"{search['chosen_cost_bytes'] / 2**20:.3f} MiB. Base (classifier) mean training loss "
        f"{search['base_loss']:.4f}. Best candidates:",
        "",
        "| layer | channel ratio | loss drop | memory cost | chosen |",
        "|---|---|---|---|---|",
        *[f"| {r['module']} | {r['ratio']:g} | {r['contribution']:+.4f} | "
          f"{r['cost_bytes'] / 2**10:.1f} KiB | {'yes' if r['chosen'] else ''} |"
          for r in sorted(search["candidates"], key=lambda r: -r["contribution"])[:8]],
        "",
        "## Fine-tuning on real data",
        "",
        f"Task: {tune['task']} ({tune['steps']} steps).",
        "",
        "![fine-tuning loss and accuracy, compiled vs PyTorch](plots/finetune.svg)",
        "",
        "| | accuracy | final-epoch loss |",
        "|---|---|---|",
        f"| before fine-tuning | {tune['accuracy_before']:.3f} | |",
        f"| compiled step | {tune['accuracy_compiled']:.3f} | "
        f"{tune['final_epoch_loss_compiled']:.4f} |",
        f"| PyTorch, same update | {tune['accuracy_pytorch']:.3f} | "
        f"{tune['final_epoch_loss_pytorch']:.4f} |",
        "",
    ]
    lines += kernel_profile(json.loads((ARTIFACTS / "profile" / "kernels.json").read_text()))
    lines += text_models(json.loads((ARTIFACTS / "workloads" / "metrics.json").read_text()),
                         json.loads((ARTIFACTS / "text_task" / "metrics.json").read_text()))
    lines += device_table(require(params, "devices"))
    return "\n".join(lines)


def text_models(workloads: dict, task: dict) -> list[str]:
    """The workloads stage's speed rows and the text task's scores, per model and scheme."""
    lines = ["## Text models (host, compiled step vs PyTorch, same run)", "",
             "| model | scheme | tokens/s | ms/step | vs eager full BP | vs eager, same layers "
             "frozen | vs torch.compile | peak memory vs eager | tuned kernels |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, rows in workloads.items():
        eager = rows["torch_eager_full"]
        lines.append(f"| {model} | PyTorch eager full BP | {eager['tokens_per_s']:.0f} | "
                     f"{eager['median_ms']:.1f} | | | | | |")
        for name, row in rows["schemes"].items():
            memory = row["memory_ratio_vs_torch_eager_full"]
            lines.append(
                f"| {model} | {name} | {row['compiled']['tokens_per_s']:.0f} | "
                f"{row['compiled']['median_ms']:.1f} | {row['speedup_vs_torch_eager_full']:.2f}x "
                f"| {row['speedup_vs_torch_eager_frozen']:.2f}x | "
                f"{row['speedup_vs_torch_compile_full']:.2f}x | "
                f"{'' if memory is None else f'{memory:.2f}'} | "
                f"{row['tuned_kernels']} |")
    lines += ["", f"Text task ({task['model']}, {task['data']}): {task['task']}; "
                  f"{task['train_sentences']} training sentences, {task['epochs']} epoch(s), "
                  f"{task['test_sentences']} test sentences; accuracy before fine-tuning "
                  f"{task['accuracy_before']:.3f}.", "",
              "| scheme | trainable | accuracy, compiled | accuracy, PyTorch | last-epoch loss, "
              "compiled | last-epoch loss, PyTorch |", "|---|---|---|---|---|---|"]
    for name, row in task["schemes"].items():
        lines.append(f"| {name} | {row['trainable_fraction']:.2%} | "
                     f"{row['accuracy_compiled']:.3f} | {row['accuracy_pytorch']:.3f} | "
                     f"{row['final_epoch_loss_compiled']:.4f} | "
                     f"{row['final_epoch_loss_pytorch']:.4f} |")
    return lines + [""]


def kernel_profile(profile: dict) -> list[str]:
    """Where the host build's step spends its time (the profile stage)."""
    def share(table: dict) -> str:
        return ", ".join(f"{k} {v['ms_per_step']:.2f} ms ({v['share']:.0%})"
                         for k, v in table.items())

    lines = ["## Where the time goes (host build, kernel by kernel)", "",
             f"{profile['calls_per_step']} VM calls per step take {profile['kernel_time_ms']:.2f} "
             f"ms (the plain step: {profile['plain_step_ms']:.2f} ms). Timing every call costs "
             f"about {profile['instrument_us_per_call']:.1f} µs per call, part of which lands "
             "inside the timed calls: small calls, such as the VM's builtins, read high.", "",
             f"- by phase: {share(profile['phases'])}",
             f"- by kind: {share(profile['kinds'])}", "",
             "| kernel | phase | kind | calls/step | ms/step | share |", "|---|---|---|---|---|---|"]
    for row in profile["top_kernels"]:
        lines.append(f"| `{row['kernel']}` | {row['phase']} | {row['kind']} | "
                     f"{row['calls_per_step']} | {row['ms_per_step']:.3f} | {row['share']:.1%} |")
    return lines + [""]


def device_table(devices: list[str]) -> list[str]:
    """One row per device profile: built, where it ran, loss against the host build, time."""
    lines = ["## Devices", "",
             "| device | target | built | ran | loss matches host | step latency |",
             "|---|---|---|---|---|---|"]
    for device in devices:
        built = json.loads((ARTIFACTS / "build" / device / "manifest.json").read_text())["params"]
        bench = json.loads((ARTIFACTS / "benchmark" / f"{device}.json").read_text())
        target = built["profile"]["target"]
        kind = target["kind"] + (f" {target['mcpu']}" if "mcpu" in target else "") + (
            f" {target['arch']}" if "arch" in target else "")
        tuned = built.get("kernel_schedules", {}).get("tuned")
        what = (f"yes: {built['library']}, {_mib(built['library_bytes'])}"
                + (" (objects the device links)" if built["links_on_device"] else "")
                + (f"; {tuned} kernels tuned (tune@{device})" if tuned else ""))
        if not bench["ran"]:
            ran, matches, latency = "not run (runner none)", "", ""
        elif bench["runner"] == "local":
            ran, matches = "local", "(is the host)" if device == "host" else ""
            latency = f"{bench['compiled']['median_ms']:.2f} ms"
        elif bench["verdict"] == "out_of_memory":
            ran, matches = bench["runner"], ""
            latency = f"out of memory ({bench['memory_mb']} MiB)"
        else:
            ran = bench["runner"]
            matches = (f"{'yes' if bench['matches_host'] else 'NO'} ({bench['loss']:.6f} vs "
                       f"{bench['loss_host']:.6f})")
            latency = (f"{bench['emulated']['median_ms']:.1f} ms emulated (qemu, not the "
                       "device's speed)" if "emulated" in bench
                       else f"{bench['container']['median_ms']:.2f} ms in a container "
                       "(this machine's cores)" if "container" in bench
                       else f"{bench['compiled']['median_ms']:.2f} ms")
        lines.append(f"| {device} | {kind} | {what} | {ran} | {matches} | {latency} |")
    return lines + [""]


def main() -> None:
    params = load_params()
    text = render(params)
    write_plots(
        PLOTS,
        {d: json.loads((ARTIFACTS / "benchmark" / f"{d}.json").read_text())
         for d in require(params, "devices")},
        json.loads((ARTIFACTS / "schemes" / "metrics.json").read_text()),
        json.loads((ARTIFACTS / "finetune" / "loss.json").read_text()),
        json.loads((ARTIFACTS / "finetune" / "accuracy.json").read_text()))
    write_text_atomic(ARTIFACTS / "report.md", text)
    print(text)


if __name__ == "__main__":
    run_stage(main)
