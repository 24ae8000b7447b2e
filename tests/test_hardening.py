"""Bad input and bad steps, refused with a clear error, nothing kept of what failed:

- a batch with labels the loss cannot score (10 of 5 classes, -5, 1e9) or non-finite inputs is
  refused naming the step and the array; the state stays as it was (runtime/checks.py);
- the fused loss never reads out of bounds: a label out of range scores nothing, as an ignored
  one does (kernels/softmax_nll.py), where a batch reaches the step unchecked;
- a step whose loss or new state is not finite keeps the state before it;
- a malformed conf/ file, a momentum of 2: refused at compose time, exit 2, naming the file;
- `pock` acts on the checkout of the current directory, and refuses outside one;
- a build leaves no scratch directory behind.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter

from pipelines.compile import build, optimize, prune, training_graph
from pipelines.config import Optimizer
from pipelines.frontends.torch_program import translate
from pipelines.io import ROOT
from pipelines.ir import signature_of
from pipelines.phases import Lowered, PrunedStep
from pipelines.runtime.checks import StepError
from pipelines.runtime.step import CompiledStep

SGD = TypeAdapter(Optimizer).validate_python({"kind": "sgd", "lr": 0.1, "momentum": 0.9})
CLASSES = 5


@pytest.fixture(scope="module")
def built(tmp_path_factory, host_profile):
    """A small classifier's step (12 -> 32 -> 5, full BP), built for the host: its directory
    and initial values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, CLASSES))
    main, names, origins = translate(torch.export.export(model, (torch.zeros(8, 12),)))
    full = training_graph(Lowered(main, names, origins, values={}, layers={}), SGD).module
    selection = dict.fromkeys(signature_of(full)["source_names"].values())
    optimized = optimize(PrunedStep(prune(full, selection, "full"), [], {}))
    directory = tmp_path_factory.mktemp("step")
    build(optimized.module, optimized.plan, host_profile, directory)
    state, source = model.state_dict(), signature_of(optimized.module)["source_names"]
    return directory, {r: state[t].numpy() for r, t in source.items()}


def batch(labels=None):
    rng = np.random.default_rng(0)
    y = np.array(labels if labels is not None else rng.integers(0, CLASSES, 8), "int64")
    return rng.standard_normal((8, 12)).astype("float32"), y


def state_of(step) -> dict:
    return {name: value.numpy().copy() for name, value in step.state.items()}


@pytest.mark.parametrize("label", [CLASSES, -5, 10**9])
def test_labels_out_of_range_are_refused_and_nothing_changes(built, label):
    step = CompiledStep(*built)
    before = state_of(step)
    labels = [0, 1, 2, 3, 4, label, 1, 2]
    with pytest.raises(StepError, match=rf"step 1: labels \[{label}\] are out of range; "
                                        r"allowed: 0 to 4 .* or -100 \(scores nothing\)"):
        step.step(*batch(labels))
    assert all(np.array_equal(v, before[k]) for k, v in state_of(step).items())
    assert step.steps == 0
    step.step(*batch([0, 1, 2, 3, 4, -100, 1, 2]))  # an ignored label is a label
    assert step.steps == 1


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_inputs_are_refused(built, value):
    step = CompiledStep(*built)
    x, y = batch()
    x[3, 4] = value
    with pytest.raises(StepError, match="step 1: input 'input' holds 1 non-finite values"):
        step.step(x, y)


def test_the_fused_loss_scores_a_label_out_of_range_as_ignored(built):
    """Bypassing the checks (the compiled function itself), an out-of-range label reads
    nothing out of bounds: its row counts as an ignored one."""
    step = CompiledStep(*built)
    x, _ = batch()
    losses = {}
    for label in (CLASSES, 10**9, -5, -100):
        y = np.array([0, 1, 2, 3, 4, label, 1, 2], "int64")
        losses[label] = float(step.function(*step.arguments(x, y))[0].numpy())
    assert np.isfinite(losses[-100])
    assert losses[CLASSES] == losses[10**9] == losses[-5] == losses[-100]


@pytest.mark.parametrize("bad, message", [("2.weight", "its loss is not finite"),
                                           ("0.weight", "its new 0.weight is not finite")])
def test_a_non_finite_loss_or_state_keeps_the_state_before_the_step(built, bad, message):
    """A NaN in the head makes the loss NaN; an inf in the first layer saturates tanh (the
    loss stays finite) but stays in its new weight."""
    directory, initial = built
    step = CompiledStep(directory, initial)
    names = {source: name for name, source in step.signature["source_names"].items()}
    broken = {name: value.copy() for name, value in initial.items()}
    broken[names[bad]][0, 0] = np.nan if bad == "2.weight" else np.inf
    step = CompiledStep(directory, broken)
    before = state_of(step)
    with pytest.raises(StepError, match=f"step 1: {message}"):
        step.step(*batch())
    after = state_of(step)
    assert all(np.array_equal(after[k], v, equal_nan=True) for k, v in before.items())


def checkout_copy(repo):
    """The checkout's tracked files, as they are, copied to ``repo`` (its code is what runs
    there: `python -m` takes the current directory's)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    return repo


def _compose(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "pipelines.cli", "compose", *args], cwd=cwd,
                          capture_output=True, text=True)


def test_a_malformed_conf_file_is_named_with_exit_2(tmp_path):
    from pipelines.io import sha256_file

    repo = checkout_copy(tmp_path / "repo")
    (repo / "conf/optimizer/sgd.yaml").write_text("kind: sgd\nlr: [0.1\n")
    params = sha256_file(repo / "params.yaml")
    run = _compose(cwd=repo)
    assert run.returncode == 2
    assert "conf/optimizer/sgd.yaml line 3, column 1: not valid YAML" in run.stderr
    assert sha256_file(repo / "params.yaml") == params  # nothing written


def test_a_momentum_with_no_meaning_is_refused():
    from pipelines.compose import compose_text
    from pipelines.schema import ConfigError

    with pytest.raises(ConfigError, match=r"optimizers\.sgd\.momentum=2 \(from "
                                          r"conf/optimizer/sgd\.yaml\): Input should be less "
                                          r"than 1"):
        compose_text(["optimizers.sgd.momentum=2"])


def test_pock_acts_on_the_checkout_of_the_current_directory(tmp_path):
    outside = _compose("--check", cwd=tmp_path)
    assert outside.returncode == 2 and "is not in a pockengine checkout" in outside.stderr
    repo = checkout_copy(tmp_path / "repo")
    ours = (ROOT / "params.yaml").read_bytes()
    assert _compose("seed=3", cwd=repo / "conf").returncode == 0  # from a subdirectory too
    assert "seed: 3" in (repo / "params.yaml").read_text()
    assert (ROOT / "params.yaml").read_bytes() == ours


def test_the_openblas_scratch_directory_goes_with_its_process(tmp_path):
    probe = ("from pipelines.backend.blas import _openblas_module, shim_object; "
             "_openblas_module(); print(shim_object().parent)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.stdout.strip().startswith(str(tmp_path))
    assert not list(tmp_path.iterdir())
