"""The report's time-to-first-step table: how long each compile phase's stage ran for a case
(artifacts/metrics/time/, pipelines/stage.py), then loading the built step and its first step
(evaluate@'s speed worker), beside the peers' setup and first step in the same run."""
from __future__ import annotations

# The compile phases in the chain's order, and what each is keyed by in its metrics' names.
PHASES = {"import": "model", "lower": "model", "autodiff": "case", "prune": "case",
          "optimize": "case", "tune": "host", "build": "host"}
FIRST_STEP_PEERS = {"torch_eager_full": "eager full", "torch_compile_full": "torch.compile"}


def phase_key(phase: str, case: str, model: str) -> str:
    return {"model": model, "case": case, "host": f"{case}-host"}[PHASES[phase]]


def _s(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.1f} s"


def _first(row: dict | None) -> float | None:
    """A speed row's setup and first step, in seconds."""
    return None if row is None else row["setup_s"] + row["first_step_ms"] / 1e3


def first_step_table(model: str, names: list[str], found: dict) -> list[str]:
    """Per case of ``model``: each phase's seconds, their sum, the compiled step's setup and
    first step, the time to the first step from the model; then the peers' setup and first
    step. Cases whose phases were not all timed (metrics from before the phases were) are left
    out."""
    rows = []
    for name in names:
        seconds = [(found["time"][phase].get(phase_key(phase, name, model)) or {}).get("seconds")
                   for phase in PHASES]
        speed = (found["evaluate"].get(name) or {}).get("speed") or {}
        if None in seconds or "setup_s" not in speed.get("compiled", {}):
            continue
        compiled, loaded = sum(seconds), _first(speed["compiled"])
        rows.append(f"| {name} | " + " | ".join(_s(s) for s in seconds)
                    + f" | {_s(compiled)} | {_s(loaded)} | **{_s(compiled + loaded)}** | "
                    + " | ".join(_s(_first(speed.get(peer))) for peer in FIRST_STEP_PEERS)
                    + " |")
    if not rows:
        return []
    return [f"### {model}: time to the first step (from the model, on the host)", "",
            "| case | " + " | ".join(PHASES) + " | compiled in | load + first step "
            "| time to first step | " + " | ".join(f"{p}: setup + first step"
                                                for p in FIRST_STEP_PEERS.values()) + " |",
            "|---" * (5 + len(PHASES) + len(FIRST_STEP_PEERS)) + "|", *rows, "",
            "Each phase is its stage's whole process, Python's start and imports included, "
            f"as `dvc repro` runs it; {', '.join(p for p, k in PHASES.items() if k == 'model')} "
            "run once per model and are shared by its cases. DVC caches every phase: a rerun "
            "with nothing changed takes none of it, and a changed scheme reruns from autodiff. "
            "Load + first step: loading the built library and the state, then one step; the "
            "peers' first step is where torch.compile compiles and PyTorch's optimizer makes "
            "its state.", ""]
