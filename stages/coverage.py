"""coverage: every architecture of transformers' causal-LM, sequence- and image-classification
auto mappings through the chain and one full-BP step against PyTorch's
(pipelines/evaluate/coverage.py). Outside the default pipeline: `dvc repro coverage/dvc.yaml`.

Each architecture runs in a process of its own (a segfault or a hang is its record, not the
end of the run), at most ``--timeout`` seconds, ``--jobs`` at once (each compiles on a core:
`--jobs 2` on two cores). Records are appended as they come, so an
interrupted run resumes where it stopped; records made by other code are made again.

Output: artifacts/coverage/records.jsonl (one record per architecture), the metric
artifacts/metrics/coverage.json (per task: how many reach each phase, the share that matches)
and docs/coverage.md (the table, and the failures grouped by cause).
"""
import argparse
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

from pipelines.evaluate.coverage import TASKS, architectures, check, summary
from pipelines.evaluate.coverage_table import render
from pipelines.io import ARTIFACTS, ROOT, sha256_file, write_json_atomic, write_text_atomic
from pipelines.progress import progress
from pipelines.stage import run_stage

OUT = ARTIFACTS / "coverage"


def main(timeout_s: float, only: str | None, jobs: int) -> None:
    code = sha256_file(ARTIFACTS / "code" / "coverage.txt")[:16]
    records_path = OUT / "records.jsonl"
    OUT.mkdir(parents=True, exist_ok=True)
    kept = {}
    if records_path.exists():
        for line in records_path.read_text().splitlines():
            record = json.loads(line)
            if record.get("code") == code:
                kept[(record["task"], record["architecture"])] = record
    write_text_atomic(records_path, "".join(json.dumps(r, sort_keys=True) + "\n"
                                            for r in kept.values()))
    todo = [a for a in architectures() if (only is None or only in a[2])
            and (TASKS[a[0]][0], a[2]) not in kept]
    with ThreadPoolExecutor(jobs) as pool:  # each job a process of its own
        running = [pool.submit(_in_a_process, *a, timeout_s) for a in todo]
        for future in progress(as_completed(running), desc="coverage", total=len(running),
                               unit="architecture"):
            record = {**future.result(), "code": code}
            kept[(record["task"], record["architecture"])] = record
            with open(records_path, "a") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
    records = sorted(kept.values(), key=lambda r: (r["task"], r["architecture"]))
    write_json_atomic(ARTIFACTS / "metrics" / "coverage.json", summary(records))
    write_text_atomic(ROOT / "docs" / "coverage.md", render(records))
    for task, counts in summary(records).items():
        print(f"coverage: {task}: {counts['ok']} of {counts['architectures']} match PyTorch")


def _in_a_process(mapping: str, model_type: str, name: str, timeout_s: float) -> dict:
    directory = OUT / "work" / name
    base = {"architecture": name, "model_type": model_type, "task": TASKS[mapping][0]}
    try:
        done = subprocess.run([sys.executable, "-m", "stages.coverage", "--one", mapping,
                               model_type, name], capture_output=True, text=True,
                              timeout=timeout_s, cwd=ROOT)
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return json.loads(lines[-1])
        tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
        return {**base, "phase": "crashed", "error": f"exit {done.returncode}: {tail}"}
    except subprocess.TimeoutExpired:
        return {**base, "phase": "crashed", "error": f"over {timeout_s:.0f} s"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def one(mapping: str, model_type: str, name: str) -> None:
    print(json.dumps(check(mapping, model_type, name, OUT / "work" / name), sort_keys=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds an architecture may take (default 600)")
    parser.add_argument("--only", help="architectures whose class name contains this")
    parser.add_argument("--jobs", type=int, default=1,
                        help="architectures checked at once, one process each (default 1)")
    parser.add_argument("--one", nargs=3, metavar=("MAPPING", "MODEL_TYPE", "CLASS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(*args.one)
    else:
        run_stage(main, args.timeout, args.only, args.jobs)
