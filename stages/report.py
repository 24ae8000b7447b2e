"""report: every metric in markdown tables, per model and case, next to PyTorch, with plots
(pipelines/report/).

Output: artifacts/report.md and artifacts/plots/ (plot data for `dvc plots show` and the SVGs
the report embeds).
"""
from pipelines.config import load_params
from pipelines.io import ARTIFACTS, atomic_dir, write_text_atomic
from pipelines.report.plots import write_plots
from pipelines.report.render import cases_by_model, load, render
from pipelines.stage import run_stage


def main() -> None:
    params = load_params()
    cases = {name: case.model_dump() for name, case in params.cases.items()}
    found = load(ARTIFACTS / "metrics", cases, params.deploy, params.devices,
                 params.package.devices, params.profile)
    with atomic_dir(ARTIFACTS / "plots") as tmp:
        write_plots(tmp, found, params.deploy, cases_by_model(cases))
    write_text_atomic(ARTIFACTS / "report.md", render(found, cases, params.deploy))
    print(f"report: {ARTIFACTS / 'report.md'}")


if __name__ == "__main__":
    run_stage(main)
