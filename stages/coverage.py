"""coverage: every architecture of transformers' causal-LM, sequence- and image-classification
auto mappings, shrunk, through the chain and one full-BP step against PyTorch's
(pipelines/coverage/). Outside the default pipeline: `dvc repro coverage/dvc.yaml`.

Each architecture runs in a process of its own, at most ``--timeout`` seconds, ``--jobs`` at
once (each compiles on a core); an interrupted run resumes where it stopped, and one given
``--minutes`` starts no check after them and writes what it has (a run cut short, which the
next resumes).

Output: artifacts/coverage/records.jsonl (one record per architecture), the metric
coverage/metrics.json (per task: how many stop at each phase, the share that matches) and
docs/coverage.md (the table, and the failures grouped by cause).
"""
import argparse

from pipelines.coverage.check import architectures, summary
from pipelines.coverage.run import run_all
from pipelines.coverage.table import render
from pipelines.io import ARTIFACTS, ROOT, sha256_file, write_json_atomic, write_text_atomic
from pipelines.stage import run_stage

OUT = ARTIFACTS / "coverage"


def main(timeout_s: float, jobs: int, only: str | None, minutes: float | None) -> None:
    code = sha256_file(ARTIFACTS / "code" / "coverage.txt")[:16]
    OUT.mkdir(parents=True, exist_ok=True)
    records = run_all(OUT / "records.jsonl", OUT / "work", code, timeout_s, jobs, only, minutes)
    write_json_atomic(ROOT / "coverage" / "metrics.json", summary(records))
    expected = len([a for a in architectures() if only is None or only in a[2]])
    write_text_atomic(ROOT / "docs" / "coverage.md", render(records, expected))
    for task, counts in summary(records).items():
        print(f"coverage: {task}: {counts['ok']} of {counts['architectures']} match PyTorch")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one architecture may take (default 600)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="architectures checked at once (default 1)")
    parser.add_argument("--only", help="only the architectures whose class name has this")
    parser.add_argument("--minutes", type=float,
                        help="start no check after this many minutes (default: no limit)")
    args = parser.parse_args()
    run_stage(main, args.timeout, args.jobs, args.only, args.minutes)
