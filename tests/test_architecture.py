"""The shape of the project: a library (pipelines/) and thin DVC stages (stages/) that call it.

- the import-linter contracts (.importlinter) hold: stages -> pipelines only, no stage imports
  another, nothing imports a __main__, layers inside the library point down;
- each stage is a short module;
- dvc.yaml's code deps cannot drift: every stage depends on its own code list
  (artifacts/code/<module>.txt, written by the code stage from pipelines/code.py's import
  closure) and on no code file or folder directly; the closure holds every project module the
  stage really imports (checked against a fresh interpreter's sys.modules);
- a change to one scheme changes the resolved inputs of exactly that scheme's cases.
"""
import json
import re
import subprocess
import sys

import pytest
import yaml

from pipelines.code import closure, stage_modules
from pipelines.io import ROOT

STAGE_LINES = 60  # "about 40": a stage reads params, calls the library, writes outputs


def dvc_stages() -> dict:
    """The stages of dvc.yaml and of the pipelines outside the default one (coverage/)."""
    stages = {}
    for path in [ROOT / "dvc.yaml", *sorted(ROOT.glob("*/dvc.yaml"))]:
        stages.update(yaml.safe_load(path.read_text())["stages"])
    return stages


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


def test_a_changed_scheme_changes_only_its_cases_inputs(params):
    """The resolve stage's files are each stage's inputs (dvc.yaml: every stage after resolve
    depends on its own): a change to one scheme changes the autodiff inputs (which batch norms
    keep their statistics) and prune inputs of exactly the cases that use it, and nothing of
    any other case, model or device."""
    from pipelines.config import validate
    from pipelines.resolve import resolve

    before = resolve(params)
    data = params.model_dump()
    data["schemes"]["mbv2_channels"]["rules"][0]["channels"] = 0.5
    after = resolve(validate(data))
    cases = sorted(n for n, c in params.cases.items() if c.scheme == "mbv2_channels")
    changed = {str(path.relative_to(ROOT / "artifacts/resolved"))
               for path in before if before[path] != after[path]}
    assert cases and changed == {f"cases/{case}/{stage}.json" for case in cases
                                 for stage in ("autodiff", "prune")}


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
