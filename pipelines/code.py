"""The code a stage runs: the project files in its module's import closure (imports inside
functions too, and the entries registries import: pipelines/registry.py) and the files they
read beside themselves (``Path(__file__).with_name(...)``:
the OpenBLAS shim's source, the scripts that run on a device).

The code stage writes, per stage, the list of those files with their hashes
(artifacts/code/<stage>.txt); each stage depends on its own list in dvc.yaml. A stage reruns
exactly when a file it runs changes, and no hand-written list can drift from the imports.
"""
from __future__ import annotations

import ast
from pathlib import Path

from pipelines.io import ROOT, sha256_file

PACKAGES = ("pipelines", "stages")


def module_file(name: str) -> Path | None:
    """The file of a project module (a package's __init__.py), or None if there is none."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _registered(node: ast.AST, module: str) -> list[str]:
    """The entries a registry call imports: ``entries(__name__, ("a", "b"), ...)`` in package
    ``module`` (pipelines/registry.py) -> ["module.a", "module.b"]."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "entries"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Tuple)):
        return []
    package = node.args[0]
    package = module if getattr(package, "id", None) == "__name__" else package.value
    return [f"{package}.{entry.value}" for entry in node.args[1].elts]


def _imported(tree: ast.AST, module: str) -> set[str]:
    """Project module names an AST (of ``module``) imports, with their parent packages."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif _registered(node, module):
            found = _registered(node, module)
        else:
            continue
        for name in found:
            parts = name.split(".")
            if parts[0] in PACKAGES:
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {name for name in names if module_file(name)}


def _read_beside(tree: ast.AST, path: Path) -> set[Path]:
    """Files a module reads beside itself: ``Path(__file__).with_name("<file>")``."""
    files = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "with_name" and node.args
                and isinstance(node.args[0], ast.Constant)
                and (path.parent / str(node.args[0].value)).is_file()):
            files.add(path.parent / str(node.args[0].value))
    return files


def closure(module: str) -> list[Path]:
    """Every project file ``module`` runs, sorted."""
    parts = module.split(".")  # importing a module runs its packages' __init__ first
    seen, files, todo = set(), set(), [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            raise ModuleNotFoundError(f"no project module {name!r}")
        files.add(path)
        tree = ast.parse(path.read_text(), str(path))
        files |= _read_beside(tree, path)
        todo += sorted(_imported(tree, name) - seen)
    return sorted(files)


def listing(module: str) -> str:
    """``<sha256>  <path>`` per file of the closure: the stage's code list."""
    return "".join(f"{sha256_file(path)}  {path.relative_to(ROOT)}\n"
                   for path in closure(module))


def stage_modules() -> list[str]:
    """Every stage's module (stages/<name>.py)."""
    return sorted(f"stages.{p.stem}" for p in (ROOT / "stages").glob("*.py")
                  if p.stem != "__init__")
