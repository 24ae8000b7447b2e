"""The report's plots: data files for `dvc plots show` and the same figures as SVG for report.md.

- latency.json / .svg: step latency per case on the host, compiled vs its PyTorch peers;
- memory.json / .svg: per case, the memory the step holds beyond its batch: weights,
  optimizer state, parameter gradients, activations kept for backward;
- finetune-<case>.svg: a deploy case's fine-tuning loss and test accuracy, compiled step vs
  PyTorch (the data are evaluate@<case>'s curves, which DVC plots directly);
- peers-<model>.json / .svg: per model, how many times faster each case's compiled step is
  than each peer that timed it on the host in the same run;
- gpu-<run>.json / .svg: per committed GPU run (artifacts/metrics/gpu/<run>.json), how many
  times faster each case's compiled step is than each peer in the same run.
SVGs are written without dates and with a fixed hash salt, so the same metrics give the same
bytes.
"""
from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402

from pipelines.io import write_json_atomic, write_text_atomic  # noqa: E402
from pipelines.report.render import PEERS, timed_peers  # noqa: E402

MEMORY_PARTS = {"weights_bytes": "weights", "optimizer_state_bytes": "optimizer state",
                "param_grad_bytes": "parameter gradients",
                "saved_activation_bytes": "activations kept for backward"}


def latency_rows(found: dict) -> list[dict]:
    rows = []
    for case, metrics in found["evaluate"].items():
        speed = (metrics or {}).get("speed")
        if not speed:
            continue
        for key, label in (("torch_eager_full", "PyTorch eager full BP"),
                           ("torch_eager_frozen", "PyTorch eager, same layers frozen"),
                           ("torch_compile_full", "torch.compile full BP"),
                           ("compiled", "compiled")):
            if key in speed:
                rows.append({"case": f"{case}: {label}", "ms": speed[key]["median_ms"]})
    return rows


def memory_rows(found: dict) -> list[dict]:
    rows = []
    for case, report in found["prune"].items():
        if report is None:
            continue
        parts = {"weights_bytes": report["full"]["param_grad_bytes"], **report["pruned"]}
        rows += [{"case": case, "part": part, "MiB": parts[key] / 2**20}
                 for key, part in MEMORY_PARTS.items()]
    return rows


def gpu_rows(run: dict) -> list[dict]:
    """A GPU run's speedups: the compiled step's speed over each peer's, per case."""
    return [{"case": case, "peer": label, "speedup": speed[f"speedup_vs_{peer}"]}
            for case, result in run.items() if case != "machine"
            for speed in [result.get("speed", {})]
            for peer, label in PEERS.items() if f"speedup_vs_{peer}" in speed]


def peer_rows(names: list[str], found: dict) -> list[dict]:
    """The host's speedups of the cases ``names`` over each peer that timed them."""
    peers = timed_peers(names, found)
    return [{"case": name, "peer": peer, "speedup": speed[f"speedup_vs_{peer}"]}
            for name in names for speed in [(found["evaluate"][name] or {}).get("speed") or {}]
            for peer in peers if f"speedup_vs_{peer}" in speed]


def _svg(fig) -> str:
    plt.rcParams["svg.hashsalt"] = "pockengine"
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def latency_svg(rows: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(rows) + 1))
    labels = [r["case"] for r in rows][::-1]
    values = [r["ms"] for r in rows][::-1]
    colors = ["tab:gray" if "PyTorch" in label else "tab:blue" for label in labels]
    ax.barh(labels, values, color=colors)
    ax.set_xlabel("ms per training step (median)")
    ax.set_title("Step latency: compiled vs PyTorch")
    return _svg(fig)


def memory_svg(rows: list[dict]) -> str:
    schemes = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(schemes) + 1.2))
    left = [0.0] * len(schemes)
    for part in MEMORY_PARTS.values():
        widths = [next(r["MiB"] for r in rows if r["case"] == s and r["part"] == part)
                  for s in schemes]
        ax.barh(schemes[::-1], widths[::-1], left=left[::-1], label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("MiB")
    ax.set_title("Training memory per case (beyond the batch)")
    ax.legend(fontsize="small", loc="lower right")
    return _svg(fig)


def finetune_svg(loss: list[dict], evaluations: list[dict]) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    for key, style in (("pytorch", "--"), ("compiled", "-")):
        left.plot([r["step"] for r in loss], [r[key] for r in loss], style, label=key)
        right.plot([r["epoch"] for r in evaluations], [r[key] for r in evaluations],
                   style + "o", label=key)
    metric = evaluations[0].get("metric", "accuracy").replace("_", " ")
    left.set(xlabel="step", ylabel="loss", title="Fine-tuning loss")
    right.set(xlabel="epoch", ylabel=metric, title=f"Held-out {metric}")
    left.legend()
    right.legend()
    return _svg(fig)


def speedup_svg(rows: list[dict], where: str, title: str) -> str:
    """Bars of the compiled step's speedup over each peer, per case (``rows``: peer_rows or
    gpu_rows)."""
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(rows) + 1.2))
    labels = [f"{r['case']}: vs {r['peer']}" for r in rows][::-1]
    ax.barh(labels, [r["speedup"] for r in rows][::-1], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)  # as fast as the peer
    ax.set_xscale("log")
    ax.set_xlabel(f"compiled step's speed over the peer's (x, {where}, same run)")
    ax.set_title(title)
    return _svg(fig)


def gpu_svg(rows: list[dict], gpu: str) -> str:
    return speedup_svg(rows, "same GPU", f"Fine-tuning steps on {gpu}")


def write_plots(out: Path, found: dict, deploy: list, models: dict) -> None:
    """Every plot into ``out``; ``models``: each model's cases, in order."""
    latency, memory = latency_rows(found), memory_rows(found)
    write_json_atomic(out / "latency.json", latency)
    write_json_atomic(out / "memory.json", memory)
    write_text_atomic(out / "latency.svg", latency_svg(latency))
    write_text_atomic(out / "memory.svg", memory_svg(memory))
    for model, names in models.items():
        rows = peer_rows(names, found)
        if rows:
            write_json_atomic(out / f"peers-{model}.json", rows)
            write_text_atomic(out / f"peers-{model}.svg", speedup_svg(
                rows, "host", f"{model}: fine-tuning steps beside every peer"))
    for case in deploy:
        loss, evaluations = found["curves"][case]
        if loss:
            write_text_atomic(out / f"finetune-{case}.svg", finetune_svg(loss, evaluations))
    for stem, run in found.get("gpu", {}).items():
        rows = gpu_rows(run)
        if rows:
            write_json_atomic(out / f"gpu-{stem}.json", rows)
            write_text_atomic(out / f"gpu-{stem}.svg",
                              gpu_svg(rows, run["machine"].get("gpu", "a GPU")))
