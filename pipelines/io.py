"""Reading and writing artifacts: atomic writes, manifests, hashes, arrays.

A stage writes everything into a temporary sibling and renames it into place, so a stage killed
half-way leaves no partial output behind. Manifests hold hashes and versions only (no times),
so the same inputs give the same manifest bytes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

def repository(start: Path) -> Path | None:
    """The pockengine checkout ``start`` is in (a directory with dvc.yaml, conf/ and
    pipelines/, itself or an ancestor), or None."""
    for directory in [start, *start.parents]:
        if all((directory / name).exists() for name in ("dvc.yaml", "conf", "pipelines")):
            return directory
    return None


# The checkout of the current directory, as git and dvc do: with one clone's venv active, pock
# in another clone acts on that one. Outside any, the checkout this library is in.
ROOT = repository(Path.cwd().resolve()) or Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"


class CorruptArtifact(Exception):
    """An artifact whose bytes are not the ones its stage recorded (``verified``): the message
    names the file and how to make it again. Stages and commands exit 2 on it."""


def in_checkout(path: Path) -> str:
    """``path`` as an artifact records it: from the checkout's root where it is under it (the
    same bytes in every clone), else as it is."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(path: Path) -> str:
    """Hash of a file, or of a directory's relative paths and file contents."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + sha256_file(file).encode())
    return digest.hexdigest()


def dumps_json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_text_atomic(path: Path, text: str | bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode() if isinstance(text, str) else text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; artifacts are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data) -> None:
    write_text_atomic(path, dumps_json(data))


def remove_leftovers(final: Path) -> list[Path]:
    """The temporary siblings a killed run left beside ``final`` (``.<name>.*.tmp``,
    ``.<name>.old``), removed; which. A stage's outputs are written only by that stage, one
    run at a time (DVC's lock), so a sibling of this name is never another run's."""
    final = Path(final)
    stale = sorted([*final.parent.glob(f".{final.name}.*.tmp"),
                    *final.parent.glob(f".{final.name}.old")])
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return stale


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary directory; on success it replaces ``final`` in one rename. What an
    interrupted earlier run left beside ``final`` is removed first."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def toolchain_versions() -> dict:
    # the installed distributions' versions (what tvm.__version__ and torch.__version__ say),
    # read without importing them: that takes seconds, and a data stage needs neither
    from importlib.metadata import version

    return {"python": platform.python_version(), "tvm": version("apache-tvm"),
            "torch": version("torch"), "numpy": version("numpy")}


def manifest(stage: str, inputs: dict[str, Path], params: dict, outputs: Path) -> dict:
    """What a stage read (hashes), with which settings, and what it wrote (hashes)."""
    outputs = Path(outputs)
    return {
        "stage": stage,
        "inputs": {name: sha256_tree(path) for name, path in sorted(inputs.items())},
        "params": params,
        "toolchain": toolchain_versions(),
        "outputs": {str(p.relative_to(outputs)): sha256_file(p)
                    for p in sorted(outputs.rglob("*"))
                    if p.is_file() and p.name != "manifest.json"},
    }


def write_manifest(out_dir: Path, stage: str, inputs: dict[str, Path], params: dict) -> None:
    write_json_atomic(Path(out_dir) / "manifest.json", manifest(stage, inputs, params, out_dir))


def verified(path: Path) -> Path:
    """``path``, checked to be what its stage wrote: where its directory holds a
    manifest.json (stages write one beside their outputs), the file's sha256 must be the one
    it records. A flipped byte in a built step or in weights is named before it is used."""
    path = Path(path)
    recorded = path.parent / "manifest.json"
    if recorded.exists():
        want = json.loads(recorded.read_text())["outputs"].get(path.name)
        if want is not None and sha256_file(path) != want:
            raise CorruptArtifact(f"{path}: not what {json.loads(recorded.read_text())['stage']}"
                                  " wrote (its sha256 is not the one manifest.json records); "
                                  "rerun that stage (dvc repro --force <stage>) or restore it "
                                  "(dvc checkout)")
    return path


def verified_dir(directory: Path) -> Path:
    """Every file ``directory``'s manifest.json records, checked (``verified``)."""
    recorded = Path(directory) / "manifest.json"
    if recorded.exists():
        for name in json.loads(recorded.read_text())["outputs"]:
            verified(Path(directory) / name)
    return Path(directory)


def read_json(path: Path):
    return json.loads(verified(path).read_text())


def load_arrays(path: Path) -> dict:
    """The arrays of an .npz file, by name, read into memory."""
    import numpy as np

    with np.load(verified(path)) as data:
        return {name: data[name] for name in data.files}


def load_tensors(path: Path) -> dict:
    """The tensors of a safetensors file, by name, as numpy arrays; a BF16 one (a frozen
    weight stored so) as ml_dtypes' bfloat16, which safetensors.numpy.load_file does not read
    and safe_open does once ml_dtypes has named it to numpy."""
    import ml_dtypes  # noqa: F401
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as tensors:
        return {name: tensors.get_tensor(name) for name in tensors.keys()}


def save_arrays(path: Path, arrays: dict) -> None:
    """An .npz that np.load reads, byte-identical for identical arrays (np.savez stamps the
    current time into each zip entry; this fixes it)."""
    import io
    import zipfile

    import numpy as np

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            entry = io.BytesIO()
            # order C, shape kept (np.ascontiguousarray makes a 0-d array 1-d)
            np.lib.format.write_array(entry, np.asarray(array, order="C"), allow_pickle=False)
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)),
                             entry.getvalue())
    write_text_atomic(path, buffer.getvalue())
