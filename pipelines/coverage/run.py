"""The coverage run: every architecture checked (check.py) in a process of its own, so that a
segfault or a hang is that architecture's record and not the end of the run; ``jobs`` at once.
Records are appended to a JSON-lines file as they come: an interrupted run resumes where it
stopped, and records made by other code (another ``code`` key) are made again. The mappings
take turns, so a run cut short (by its time budget, or stopped) has checked a share of each."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from itertools import chain, zip_longest
from pathlib import Path

from pipelines.coverage.check import TASKS, architectures, check
from pipelines.io import ROOT, write_text_atomic
from pipelines.progress import progress

ONE = "pipelines.coverage.run"  # `python -m` this with a mapping, model type and class: one check


def run_all(records_path: Path, work: Path, code: str, timeout_s: float, jobs: int,
            only: str | None = None, minutes: float | None = None) -> list[dict]:
    """Every architecture (whose class name contains ``only``) not yet recorded for ``code``,
    none started after ``minutes``; all records for ``code``, sorted."""
    kept = {}
    if records_path.exists():
        for line in records_path.read_text().splitlines():
            record = json.loads(line)
            if record.get("code") == code:
                kept[_key(record)] = record
    write_text_atomic(records_path, "".join(json.dumps(r, sort_keys=True) + "\n"
                                            for r in kept.values()))
    todo = [a for a in architectures() if (only is None or only in a[2])
            and (TASKS[a[0]][0], a[1], a[2]) not in kept]
    by_mapping = [[a for a in todo if a[0] == mapping] for mapping in TASKS]
    todo = [a for a in chain(*zip_longest(*by_mapping)) if a is not None]
    deadline = time.monotonic() + 60 * minutes if minutes else None
    with ThreadPoolExecutor(jobs) as pool:  # each job waits on a process of its own
        running = [pool.submit(_in_a_process, *a, work / f"{a[1]}-{a[2]}", timeout_s, deadline)
                   for a in todo]
        for future in progress(as_completed(running), desc="coverage", total=len(running),
                               unit="architecture"):
            if (checked := future.result()) is None:  # not started: the budget was spent
                continue
            record = {**checked, "code": code}
            kept[_key(record)] = record
            with open(records_path, "a") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
    return sorted(kept.values(), key=_key)


def _key(record: dict) -> tuple[str, str, str]:
    """An architecture of a task: one class can serve several model types (GPT-2's for
    gpt-sw3), each its own check."""
    return record["task"], record["model_type"], record["architecture"]


def _in_a_process(mapping: str, model_type: str, name: str, directory: Path,
                  timeout_s: float, deadline: float | None) -> dict | None:
    if deadline is not None and time.monotonic() > deadline:
        return None
    base = {"architecture": name, "model_type": model_type, "task": TASKS[mapping][0]}
    try:
        done = subprocess.run([sys.executable, "-m", ONE, mapping, model_type, name,
                               str(directory)], capture_output=True, text=True,
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


if __name__ == "__main__":
    mapping, model_type, name, directory = sys.argv[1:5]
    print(json.dumps(check(mapping, model_type, name, Path(directory)), sort_keys=True))
