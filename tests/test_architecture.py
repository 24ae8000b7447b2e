"""The shape of the project: a library (pipelines/) and thin DVC stages (stages/) that call it.

- the import-linter contracts (.importlinter) hold: stages -> pipelines only, no stage imports
  another, nothing imports a __main__, layers inside the library point down;
- each stage is a short module;
- dvc.yaml's code deps cannot drift: every stage depends on its own code list
  (artifacts/code/<module>.txt, written by the code stage from pipelines/code.py's import
  closure) and on no code file or folder directly; the closure holds every project module the
  stage really imports (checked against a fresh interpreter's sys.modules);
- a change to one scheme reruns exactly that scheme's cases (`dvc status` against the committed
  dvc.lock).
"""
import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from pipelines.code import closure, stage_modules
from pipelines.io import ROOT

STAGE_LINES = 60  # "about 40": a stage reads params, calls the library, writes outputs


def dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_import_contracts_hold():
    found = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True,
                           text=True)
    assert found.returncode == 0, found.stdout + found.stderr
    assert "0 broken" in found.stdout


@pytest.mark.parametrize("module", stage_modules())
def test_stages_are_thin(module):
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(lines) <= STAGE_LINES, f"{path.name}: {len(lines)} lines of library work?"


def test_every_stage_module_is_a_dvc_stage_and_the_reverse():
    used = {re.match(r"python -m (stages\.\w+)", spec.get("cmd") or spec["do"]["cmd"]).group(1)
            for spec in dvc_stages().values()}
    assert used == set(stage_modules())


def test_dvc_code_deps_are_the_code_lists_only():
    for name, spec in dvc_stages().items():
        body = spec.get("do", spec)
        module = re.match(r"python -m stages\.(\w+)", body["cmd"]).group(1)
        deps = [str(dep) for dep in body.get("deps", [])]
        if name == "code":
            assert deps == ["pipelines", "stages"]
            continue
        assert f"artifacts/code/{module}.txt" in deps, f"{name}: misses its code list"
        direct = [d for d in deps if d.split("/")[0] in ("pipelines", "stages")]
        assert not direct, f"{name}: code deps outside its code list: {direct}"


@pytest.mark.parametrize("module", stage_modules())
def test_code_list_covers_every_module_the_stage_imports(module):
    """The AST closure against the interpreter: what importing the stage loads (module-level
    imports, transitively) must all be in the closure, which also follows imports inside
    functions."""
    probe = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
             "print(json.dumps(sorted(getattr(m, '__file__', None) or '' "
             "for m in list(sys.modules.values()))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe, module], cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout)
    ours = {f for f in loaded if f.startswith(str(ROOT / "pipelines"))
            or f.startswith(str(ROOT / "stages"))}
    missing = ours - {str(path) for path in closure(module)}
    assert not missing, f"{module}: imports {sorted(missing)} outside its code list"


def test_closure_follows_imports_inside_functions():
    files = {path.relative_to(ROOT).as_posix() for path in closure("stages.importer")}
    # pipelines/frontends/__init__.py imports each frontend where it is used
    assert {"pipelines/frontends/onnx.py", "pipelines/frontends/keras.py"} <= files


def _scratch_copy(tmp_path):
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, target)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    return tmp_path


def _stages_with_changed_params(repo) -> set[str]:
    status = json.loads(subprocess.run(["dvc", "status", "--json"], cwd=repo, check=True,
                                       capture_output=True, text=True).stdout or "{}")
    changed = set()
    for stage, changes in status.items():
        for change in changes:
            deps = change.get("changed deps", {}) if isinstance(change, dict) else {}
            if any(isinstance(v, dict) for v in deps.values()):  # params.yaml: {key: how}
                changed.add(stage)
    return changed


def _lock_with_current_params(repo) -> None:
    """dvc.lock as if every stage had run with params.yaml as it is: each stage's recorded
    params are the values of the keys dvc.yaml gives it (read by DVC). The question here is
    which stages a change reruns, not whether the committed lock is current."""
    from dvc.repo import Repo

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    with Repo(str(repo)) as dvc:
        for stage in dvc.index.stages:
            entry = lock["stages"].setdefault(stage.name, {"cmd": stage.cmd})
            entry.pop("params", None)
            for dep in stage.params:
                entry.setdefault("params", {})[dep.def_path] = dep.read_params()
    (repo / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


@pytest.mark.skipif(not (ROOT / "dvc.lock").exists(), reason="no dvc.lock committed")
def test_a_changed_scheme_reruns_only_its_cases(tmp_path):
    repo = _scratch_copy(tmp_path)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    _lock_with_current_params(repo)
    assert _stages_with_changed_params(repo) == set()
    params["schemes"]["mbv2_channels"]["rules"][0]["channels"] = 0.5
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cases = sorted(n for n, c in params["cases"].items() if c["scheme"] == "mbv2_channels")
    assert cases
    # each of the scheme's cases from autodiff on (the scheme's rules are its params there);
    # nothing of any other case or model
    changed = _stages_with_changed_params(repo)
    assert changed and {stage.split("@")[1] for stage in changed} == set(cases), changed
    assert {stage.split("@")[0] for stage in changed} >= {"autodiff", "prune"}


def test_every_project_import_resolves():
    """Imports inside functions too: a name moved or removed fails here, not mid-pipeline."""
    import ast
    import importlib

    broken = []
    for path in sorted([*(ROOT / "pipelines").rglob("*.py"), *(ROOT / "stages").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in ("pipelines", "stages")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as err:
                broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: {err}")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        broken.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                      f"{node.module} has no {alias.name}")
    assert not broken, "\n".join(broken)
