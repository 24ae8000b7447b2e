"""Bad input and bad steps, refused with a clear error, nothing kept of what failed:

- a batch with labels the loss cannot score (10 of 5 classes, -5, 1e9), non-finite inputs, or
  an input or state of another shape or dtype (which the built step no longer checks itself)
  is refused naming the step and the array; the state stays as it was (runtime/checks.py);
- token ids past the table they index (an embedding's rows) are refused the same way, before
  the step's take could read past it (analysis/indices.py);
- the fused loss never reads out of bounds: a label out of range scores nothing, as an ignored
  one does (kernels/softmax_nll.py), where a batch reaches the step unchecked;
- a step whose loss or new state is not finite keeps the state before it, or, where it updates
  its state in place, says that it could not;
- a malformed conf/ file, a momentum of 2: refused at compose time, exit 2, naming the file;
- `pock` acts on the checkout of the current directory, and refuses outside one;
- a build leaves no scratch directory behind;
- an artifact whose bytes are not what its stage wrote is named before it is used; what a
  killed run left beside a stage's output is removed by the next run;
- optimizer state is written as safetensors, never a pickle, and loads back into torch.optim;
- a path an artifact records is from the checkout's root.
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
VOCABULARY = 20


def build_classifier(directory, host_profile, update_in_place: bool):
    """A small classifier's step (12 -> 32 -> 5, full BP), built for the host into
    ``directory``: its directory and initial values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, CLASSES))
    return build_step(model, torch.zeros(8, 12), directory, host_profile, update_in_place)


class TokenClassifier(torch.nn.Module):
    """Token ids (a vocabulary of VOCABULARY) to CLASSES: an embedding, averaged, a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, 8)
        self.head = torch.nn.Linear(8, CLASSES)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def build_step(model, example, directory, host_profile, update_in_place: bool = False):
    """``model``'s full-BP step for ``example``, built for the host into ``directory``: its
    directory and initial values."""
    main, names, origins = translate(torch.export.export(model, (example,)))
    full = training_graph(Lowered(main, names, origins, values={}, layers={}), SGD).module
    selection = dict.fromkeys(signature_of(full)["source_names"].values())
    optimized = optimize(PrunedStep(prune(full, selection, "full"), [], {}),
                         update_in_place=update_in_place)
    build(optimized.module, optimized.plan, host_profile, directory)
    state, source = model.state_dict(), signature_of(optimized.module)["source_names"]
    return directory, {r: state[t].numpy() for r, t in source.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory, host_profile):
    """The classifier's step returning its new state in fresh storage: the state before a
    failed step is still there to keep."""
    return build_classifier(tmp_path_factory.mktemp("step"), host_profile, False)


@pytest.fixture(scope="module")
def built_in_place(tmp_path_factory, host_profile):
    """The classifier's step updating its state in place (the default)."""
    return build_classifier(tmp_path_factory.mktemp("step_in_place"), host_profile, True)


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


@pytest.fixture(scope="module")
def token_step(tmp_path_factory, host_profile):
    torch.manual_seed(0)
    return build_step(TokenClassifier(), torch.zeros(8, 6, dtype=torch.int64),
                      tmp_path_factory.mktemp("tokens"), host_profile)


@pytest.mark.parametrize("token", [VOCABULARY, -1, 10**9])
def test_token_ids_past_the_embedding_are_refused_and_nothing_changes(token_step, token):
    """TVM's take reads an index past its table unchecked: the step's signature records the
    embedding's rows for the input that indexes it, and a batch with an id outside them is
    refused before the step runs, as PyTorch's embedding refuses it."""
    step = CompiledStep(*token_step)
    assert step.signature["data_types"]["ids"]["rows"] == VOCABULARY
    assert "rows" not in step.signature["data_types"]["labels"]
    before = state_of(step)
    ids = np.random.default_rng(0).integers(0, VOCABULARY, (8, 6))
    ids[2, 3] = token
    with pytest.raises(StepError, match=rf"step 1: input 'ids' holds \[{token}\], past the "
                                        rf"table it indexes; allowed: 0 to {VOCABULARY - 1}"):
        step.step(ids, np.zeros(8, "int64"))
    assert all(np.array_equal(v, before[k]) for k, v in state_of(step).items())
    ids[2, 3] = VOCABULARY - 1  # the last row is a row
    step.step(ids, np.zeros(8, "int64"))
    assert step.steps == 1


def test_inputs_and_state_of_other_shapes_are_refused_before_the_step(built):
    """The built step does not check its parameters on every call (backend/checked_once.py):
    CompiledStep checks what it is given instead, once per array, and the step is not run."""
    import tvm

    from pipelines.runtime.checks import BadBatch

    vm_text = tvm.relax.VMExecutable(tvm.runtime.load_module(
        str(built[0] / "step.so"))).as_text()
    assert "check_tensor_info" not in vm_text and "match_shape" not in vm_text
    step = CompiledStep(*built)
    x, y = batch()
    with pytest.raises(BadBatch, match=r"step 1: input 'input' is float32 \[8, 13\]; allowed: "
                                       r"float32 \[8, 12\]"):
        step.step(np.zeros((8, 13), "float32"), y)
    with pytest.raises(BadBatch, match=r"input 'labels' is int32 \[8\]; allowed: int64"):
        step.step(x, y.astype("int32"))
    name = next(iter(step.state))
    wrong = tvm.runtime.tensor(np.zeros((3,), "float32"))
    with pytest.raises(BadBatch, match=rf"state '{name}': float32 \[3\]; allowed: float32"):
        step.set_state(name, wrong)
    assert step.steps == 0
    step.step(x, y)


def test_only_a_step_of_static_shapes_loses_its_parameter_checks():
    """A symbolic shape is read by match_shape into the shape heap: that step keeps its
    checks; a static one drops them and still computes the same."""
    import tvm
    from tvm import relax
    from tvm.script import ir as I
    from tvm.script import relax as R

    from pipelines.backend.checked_once import drop_param_checks

    @I.ir_module
    class Static:
        @R.function
        def train_step(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
            return R.add(x, x)

    @I.ir_module
    class Symbolic:
        @R.function
        def train_step(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            return R.add(x, x)

    pipeline = tvm.transform.Sequential([relax.get_pipeline("default"), drop_param_checks])
    static = tvm.compile(Static, target="llvm", relax_pipeline=pipeline)
    assert "match_shape" not in static.as_text()
    x = np.arange(8, dtype="float32").reshape(2, 4)
    vm = relax.VirtualMachine(static, tvm.cpu())
    np.testing.assert_array_equal(vm["train_step"](tvm.runtime.tensor(x)).numpy(), 2 * x)
    symbolic = tvm.compile(Symbolic, target="llvm", relax_pipeline=pipeline)
    assert "match_shape" in symbolic.as_text()


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


def test_an_in_place_step_that_goes_non_finite_says_its_state_is_lost(built_in_place):
    """Updated in place, the state before the step is gone when its new values are found not
    finite: the error says so and points at the last checkpoint."""
    directory, initial = built_in_place
    names = {source: name for name, source in
             CompiledStep(directory, initial).signature["source_names"].items()}
    broken = {name: value.copy() for name, value in initial.items()}
    broken[names["2.weight"]][0, 0] = np.nan
    step = CompiledStep(directory, broken)
    assert step.in_place
    with pytest.raises(StepError, match=r"step 1: its loss is not finite \(NaN or inf\); "
                                        "the step updates its state in place: .*last checkpoint"):
        step.step(*batch())


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


def test_a_resident_state_takes_its_new_values_in_the_same_tensors(built):
    """A step replaying CUDA graphs (build.json ``cuda_graph``) reads the state from the tensors
    it captured, so CompiledStep copies each new value into them. The host build that returns
    fresh storage, held resident: the same losses and state as rebinding, in the same tensors."""
    directory, initial = built
    rebinding, resident = CompiledStep(directory, initial), CompiledStep(directory, initial)
    resident.resident = True
    tensors, before = dict(resident.state), dict(rebinding.state)
    for lr in (0.1, 0.1, 0.05):
        rebinding.set_lr(lr)
        resident.set_lr(lr)
        assert rebinding.step(*batch()) == resident.step(*batch())
    assert not any(rebinding.state[name].same_as(tensor) for name, tensor in before.items())
    assert all(resident.state[name].same_as(tensor) for name, tensor in tensors.items())
    for name, value in state_of(rebinding).items():
        np.testing.assert_array_equal(resident.state[name].numpy(), value)


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


def test_a_flipped_byte_in_a_built_step_or_weights_is_named(built, tmp_path):
    from pipelines.frontends.weights import load_weights, save_weights
    from pipelines.io import CorruptArtifact, atomic_dir, write_manifest

    directory, initial = built
    build = tmp_path / "build"
    shutil.copytree(directory, build)
    write_manifest(build, "build@test-host", {}, {})
    CompiledStep(build, initial)  # as written: loads
    library = bytearray((build / "step.so").read_bytes())
    library[len(library) // 2] ^= 1
    (build / "step.so").write_bytes(bytes(library))
    with pytest.raises(CorruptArtifact, match=r"build/step\.so: not what build@test-host wrote"):
        CompiledStep(build, initial)
    weights = tmp_path / "weights"
    with atomic_dir(weights) as out:
        save_weights({"w": torch.ones(3)}, out / "weights.safetensors")
        write_manifest(out, "weights@test", {}, {})
    data = bytearray((weights / "weights.safetensors").read_bytes())
    data[-1] ^= 1
    (weights / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptArtifact, match="weights.safetensors: not what weights@test"):
        load_weights(weights / "weights.safetensors")


def test_what_a_killed_run_left_is_removed_by_the_next(tmp_path):
    from pipelines.io import atomic_dir

    final = tmp_path / "build"
    (tmp_path / ".build.x1y2.tmp").mkdir()  # a run killed while writing
    (tmp_path / ".build.old").mkdir()  # ... or while swapping
    with atomic_dir(final) as out:
        (out / "step.so").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_optimizer_state_is_safetensors_and_loads_into_torch(tmp_path, kind):
    from pipelines.frontends.weights import load_optimizer_state, save_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
                 else torch.optim.AdamW(model.parameters(), lr=0.01))
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
    save_optimizer_state(optimizer.state_dict(), tmp_path / "optimizer.safetensors")
    assert (tmp_path / "optimizer.safetensors").read_bytes()[8:9] == b"{"  # a safetensors header
    again = type(optimizer)(model.parameters(), lr=1.0)
    again.load_state_dict(load_optimizer_state(tmp_path / "optimizer.safetensors"))
    want, got = optimizer.state_dict(), again.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for index, slots in want["state"].items():
        for key, value in slots.items():
            assert torch.equal(torch.as_tensor(got["state"][index][key]), torch.as_tensor(value))


KILLED_RUN = """
import os, signal, sys
import numpy as np
from pipelines.evaluate import finetune as run
from pipelines.io import load_arrays
sys.path.insert(0, "tests")
from conftest import model_section
from test_hardening import SGD, CLASSIFIER

directory, at = sys.argv[1], int(sys.argv[2])
taken = []
def dying(*args, **kwargs):  # SIGKILL in the middle of step ``at``
    taken.append(1)
    if len(taken) == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return pytorch_step(*args, **kwargs)
pytorch_step, run.accumulated_step = run.accumulated_step, dying
run.finetune(model_section(**CLASSIFIER), directory + "/build",
             load_arrays(directory + "/initial.npz"), SGD, load_arrays(directory + "/data.npz"),
             2, 0, checkpoints=directory + "/checkpoints", every=3)
"""
CLASSIFIER = {"frontend": "torch", "source": "tests/frontends/task_heads.py",
              "entry": "classifier", "batch_size": 4, "finetune": {"epochs": 2}}


def test_a_killed_fine_tuning_run_goes_on_to_the_same_weights(tmp_path, host_profile, capsys):
    """Killed with SIGKILL in the middle of a step (any of 20, past the first checkpoint),
    then run again: the same losses, accuracies, weights and optimizer state as a run never
    interrupted; the checkpoint is what it went on from."""
    from conftest import model_section

    from pipelines.compile import compile
    from pipelines.evaluate.finetune import finetune
    from pipelines.io import save_arrays

    model = model_section(**CLASSIFIER)
    compiled = compile(model, [{"modules": ["*"]}], SGD, host_profile, tmp_path / "build")
    rng = np.random.default_rng(0)
    data = {f"finetune_{split}_{k}": v for split, n in (("train", 40), ("test", 12))
            for k, v in (("x", rng.standard_normal((n, 5)).astype("float32")),
                         ("y", rng.integers(0, 3, n)))}
    save_arrays(tmp_path / "data.npz", data)
    save_arrays(tmp_path / "initial.npz", compiled.initial)
    whole = finetune(model, compiled.directory, compiled.initial, SGD, data, 2, 0)

    at = int(np.random.default_rng().integers(4, 20))  # any step after the first checkpoint
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path), str(at)],
                            cwd=ROOT, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert (tmp_path / "checkpoints" / "progress.json").exists()
    capsys.readouterr()
    again = finetune(model, compiled.directory, compiled.initial, SGD, data, 2, 0,
                     checkpoints=tmp_path / "checkpoints", every=3)
    # checkpoints: every 3 steps and at each epoch's end (10 steps an epoch); the last one
    # before the killed step is where the run goes on from
    resumed = max(s for s in (3, 6, 9, 10, 12, 15, 18) if s < at)
    assert f"going on from step {resumed} " in capsys.readouterr().out, at
    assert again.losses == whole.losses and again.evaluations == whole.evaluations, at
    for name, value in whole.weights.items():
        assert torch.equal(again.weights[name], value), name
    for index, slots in whole.optimizer_state["state"].items():
        for key, value in slots.items():
            assert torch.equal(again.optimizer_state["state"][index][key], value)


# Keys of the configuration with values the schema allows and values it refuses: the fuzz
# draws overrides from both.
FUZZ = {
    "seed": (["0", "7"], ["x", "1.5"]),
    "optimizers.sgd.lr": (["0.01", "1e-3"], ["0", "-1", "fast"]),
    "optimizers.sgd.momentum": (["0.0", "0.9"], ["1", "2", "-0.1"]),
    "optimizers.adam.betas": (["[0.9,0.99]"], ["[1.0,0.9]", "[0.9]"]),
    "models.mbv2.batch_size": (["4", "16"], ["0", "-8", "eight"]),
    "models.mbv2.finetune.epochs": (["1", "3"], ["0"]),
    "models.mbv2.task": (["classification"], ["segmentation"]),
    "cases.mbv2.scheme": (["full", "bias_only"], ["nope", "mbv2_papr"]),
    "cases.mbv2.optimizer": (["adam", "sgd"], ["rmsprop"]),
    "optimize.recompute": (["never", "always"], ["sometimes"]),
    "benchmark.peers": (["[torch_eager_full]"], ["[tensorflow]"]),
    "devices": (["[rpi4]", "[edge_x86,rpi4]"], ["[rpi9]", "[host]", "[../etc]"]),
    "+profiles.rpi4.target.mcpu": (["cortex-a53"], ["cortex-a999"]),
    "+profiles.rpi4.memory_mb": (["2048"], ["-1"]),
}


def test_random_overrides_compose_cleanly_or_are_refused_leaving_params_intact(tmp_path):
    """Seeded draws of 1-3 overrides, each from the allowed or the refused values: either
    params.yaml is written and checks, or a ConfigError naming a drawn key (exit 2 at the
    command line) leaves the earlier params.yaml byte-identical."""
    from pipelines.compose import compose
    from pipelines.config import validate
    from pipelines.schema import ConfigError

    output = tmp_path / "params.yaml"
    compose([], output)
    rng = np.random.default_rng(0)
    outcomes = {"written": 0, "refused": 0}
    for _ in range(40):
        keys = rng.choice(sorted(FUZZ), size=rng.integers(1, 4), replace=False)
        drawn = {key: rng.choice(FUZZ[key][int(rng.random() < 0.5)]) for key in keys}
        overrides = [f"{key}={value}" for key, value in drawn.items()]
        before = output.read_bytes()
        try:
            compose(overrides, output)
        except ConfigError as err:
            outcomes["refused"] += 1
            assert output.read_bytes() == before, overrides
            named = [key.lstrip("+").split(".")[-1] for key in drawn]
            assert any(name in str(err) for name in named) or "rpi9" in str(err) \
                or "'host'" in str(err) or "../etc" in str(err), (overrides, str(err))
            continue
        outcomes["written"] += 1
        assert all(value in FUZZ[key][0] for key, value in drawn.items()), overrides
        validate(__import__("yaml").safe_load(output.read_text()))
    assert min(outcomes.values()) >= 5, outcomes


def test_saved_arrays_keep_their_shapes(tmp_path):
    """A 0-d array (a loss, a learned scale, a step count) comes back 0-d."""
    from pipelines.io import load_arrays, save_arrays

    arrays = {"loss": np.float32(2.5) * np.ones((), "float32"), "w": np.ones((2, 3), "float32")}
    save_arrays(tmp_path / "a.npz", arrays)
    back = load_arrays(tmp_path / "a.npz")
    assert {k: v.shape for k, v in back.items()} == {"loss": (), "w": (2, 3)}


def test_a_bfloat16_state_reads_in_a_process_that_has_nothing_else_loaded(tmp_path):
    """A step's state with frozen weights in bfloat16 (safetensors' BF16) reads as ml_dtypes'
    bfloat16, bit for bit, in a fresh process that imports pipelines.io alone: numpy knows the
    dtype's name only once ml_dtypes is imported, which TVM or torch otherwise did first."""
    from safetensors.torch import save_file

    weight = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"w": weight, "loss": torch.ones(())}, str(tmp_path / "state.safetensors"))
    read = ("import sys; from pipelines.io import load_tensors; "
            "t = load_tensors(sys.argv[1]); "
            "assert 'torch' not in sys.modules and 'tvm' not in sys.modules, sys.modules.keys(); "
            "print(t['w'].dtype, t['loss'].dtype, t['w'].view('uint16').tolist())")
    out = subprocess.run([sys.executable, "-c", read, str(tmp_path / "state.safetensors")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 2)[:2] == ["bfloat16", "float32"]
    assert out.stdout.split(" ", 2)[2].strip() == str(weight.view(torch.int16).numpy()
                                                      .view("uint16").tolist())


def test_a_path_an_artifact_records_is_the_same_in_every_clone(tmp_path):
    """What a stage writes names a file of the checkout from its root (a committed database
    the tune stage started from), so that a clone elsewhere writes the same bytes."""
    from pipelines.io import in_checkout

    assert in_checkout(ROOT / "device_profiles" / "tuned") == "device_profiles/tuned"
    assert in_checkout(tmp_path) == str(tmp_path.resolve())  # outside: as it is
