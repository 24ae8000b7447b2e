"""Shared fixtures: configurations composed from conf/ with Hydra's compose API (as `pock compose`
does), and compiled steps built once per session through the library's one chain
(pipelines/compile.py: compile), with helpers that check a step against PyTorch doing the
identical update.

The fast lane is ``python -m pytest -m "not slow"``; the full suite adds the slow tests (whole
pipelines, devices, containers).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from pipelines.tasks import IGNORE_INDEX

# Two cores on CI: keep TVM's and PyTorch's thread pools from oversubscribing them.
os.environ.setdefault("TVM_NUM_THREADS", "2")
# A repository a test makes with `dvc init` has DVC's analytics on (the project's .dvc/config
# turns them off): each dvc command there leaves its unsent report in /tmp.
os.environ["DVC_NO_ANALYTICS"] = "1"
# (pipelines/__init__.py keeps PyTorch's Inductor cache out of /tmp.)

ROOT = Path(__file__).resolve().parents[1]
HOST = {"kind": "llvm"}  # this machine's CPU, default schedules


# The longest test files, longest first (the slow lane's --durations). pytest-xdist, run with
# `--dist loadfile --no-loadscope-reorder` (.ci/run), hands files to whichever worker is free in
# collection order, so the longest start first and both cores finish together; its own order
# (most tests first) started the one-test end-to-end file last, on one core, after the rest.
LONGEST_FIRST = ["test_pipeline_e2e.py", "test_hf_transformers.py", "test_train_step.py",
                 "test_peers.py", "test_llm.py", "test_frontends.py", "test_docker.py",
                 "test_gpu_bench.py", "test_tuning.py", "test_devices.py", "test_own_data.py",
                 "test_coverage.py", "test_operator_corpus.py", "test_speed.py"]


def pytest_collection_modifyitems(items):
    """The files in LONGEST_FIRST's order, then the rest as collected; each file's tests stay
    in their order (a stable sort)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def model_section(**fields):
    """A model section (conf/model/<name>.yaml's keys), checked: its frontend's Config."""
    from pydantic import TypeAdapter

    from pipelines.config import Model

    return TypeAdapter(Model).validate_python(fields)


def compose_params(*overrides: str):
    """conf/ composed with ``overrides`` and checked, as `pock compose` would write it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines.config import validate

    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return validate(OmegaConf.to_container(cfg))


@pytest.fixture(scope="session")
def params():
    """The default experiment's configuration."""
    return compose_params()


@pytest.fixture(scope="session")
def small():
    """The default experiment with text models small enough to compile in seconds: a 2-layer
    llama_tiny (d=64, vocab 256, 16 tokens) and a 2-layer MiniLM (its first pretrained layers,
    16 tokens), batch 2; MobileNetV2 as it is."""
    return compose_params(
        "models.llama_tiny.kwargs.dim=64", "models.llama_tiny.kwargs.layers=2",
        "models.llama_tiny.kwargs.heads=2", "models.llama_tiny.kwargs.hidden=96",
        "models.llama_tiny.kwargs.vocab=256", "models.llama_tiny.kwargs.seq_len=16",
        "models.llama_tiny.batch_size=2", "models.minilm.kwargs.layers=2",
        "models.minilm.kwargs.seq_len=16", "models.minilm.batch_size=2")


@pytest.fixture(scope="session")
def host_profile():
    from pipelines.profiles import load_profile

    return load_profile("host", {})


_LOWERED: dict = {}


def _case_options(params, case: str, options: dict) -> tuple:
    """compile()'s arguments for a case of a configuration: its model (imported and lowered
    once a session, whichever case uses it), the scheme's rules (or ``rules``), its optimizer
    (or ``optimizer``), the scheme's LoRA, the case's optimize settings (``recompute`` auto:
    never, which a host build takes), and ``options`` on top."""
    from pipelines.compile import import_and_lower
    from pipelines.config import case_optimize, case_optimizer

    spec = params.cases[case]
    scheme, settings = params.schemes[spec.scheme], case_optimize(params, spec)
    key = (id(params), spec.model)
    if key not in _LOWERED:
        _LOWERED[key] = import_and_lower(params.models[spec.model])
    kwargs = {"lora": scheme.lora, "scheme_name": spec.scheme, "statistics": scheme.statistics,
              "reorder_updates": settings.reorder_updates,
              "update_in_place": settings.update_in_place,
              "loss_chunk_rows": settings.loss_chunk_rows,
              "frozen_dtype": settings.frozen_dtype,
              "recompute": "always" if settings.recompute == "always" else "never",
              "lowered": _LOWERED[key], **options}
    rules = kwargs.pop("rules", scheme.rules)
    optimizer = kwargs.pop("optimizer", case_optimizer(params, spec))
    return params.models[spec.model], rules, optimizer, kwargs


_PLANNED: dict = {}


def plan_case(params, case: str, **options):
    """compile_to_plan(...) of a case (pipelines/compile.py: the chain up to optimize, in
    memory): (full, pruned, optimized), each (configuration, case, options) once a session."""
    from pipelines.compile import compile_to_plan

    key = (id(params), case, repr(sorted(options.items())))
    if key not in _PLANNED:
        model, rules, optimizer, kwargs = _case_options(params, case, options)
        _PLANNED[key] = compile_to_plan(model, rules, optimizer, **kwargs)
    return _PLANNED[key]


@pytest.fixture(scope="session")
def build_case(tmp_path_factory, host_profile):
    """compile(...) of a case of a configuration, each (case, options) built once a session:
    ``build_case(params, "mbv2_full", rules=..., optimizer=..., recompute="always")``."""
    from pipelines.compile import compile

    built = {}

    def build(params, case: str, **options):
        key = (id(params), case, repr(sorted(options.items(), key=lambda kv: kv[0])))
        if key not in built:
            model, rules, optimizer, kwargs = _case_options(params, case, options)
            built[key] = compile(model, rules, optimizer, host_profile,
                                 tmp_path_factory.mktemp(case), **kwargs)
        return built[key]

    return build


def twin_of(compiled, model):
    """The PyTorch twin of a compiled step: same module, adapters and initial values."""
    from pipelines.frontends.twin import torch_twin

    return torch_twin(model, compiled.signature, compiled.initial)


def random_batch(compiled, seed: int = 0, classes: int | None = None):
    """A seeded batch of the step's shapes: normal floats, token ids below 100 (or the
    labels' class count)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for name in compiled.signature["data"]:
        t = compiled.signature["data_types"][name]
        if "float" in t["dtype"]:
            arrays.append(rng.standard_normal(t["shape"]).astype(t["dtype"]))
        else:
            high = (classes or 10) if name == "labels" else 100
            arrays.append(rng.integers(0, high, t["shape"]).astype(t["dtype"]))
    return tuple(arrays)


def task_labels(task: str, shape: list, rng, high: int) -> np.ndarray:
    """Labels a task scores: token ids with some positions ignored (a prompt's, padding), or
    float targets."""
    if task == "regression":
        return rng.standard_normal(shape).astype("float32")
    labels = rng.integers(0, high, shape)
    keep = 0.25 if task == "masked_lm" else 0.75  # masked LM scores the masked positions only
    labels[rng.random(shape) > keep] = IGNORE_INDEX
    return labels


def assert_change_close(name: str, before, after, want, rtol: float, atol: float):
    """``after - before`` within ``rtol`` of ``want - before`` (L2 norms), plus ``atol`` per
    element: a step's change where ReLU6 may pass or block an element's gradient on either side
    of a float32 ulp (assert_steps_match)."""
    want_change = want - before
    error = np.linalg.norm(after - before - want_change)
    assert error <= atol * np.sqrt(want_change.size) + rtol * np.linalg.norm(want_change), (
        f"{name}: change off by {error:.3g}")


def assert_steps_match(compiled, model, optimizer, batches, rtol: float = 1e-4,
                       atol: float = 1e-6, change_rtol: float | None = None,
                       loss_rtol: float | None = None, twin=None) -> tuple[dict, dict]:
    """Run the compiled step and PyTorch's step (models/pytorch.py) from the same state for
    each batch: the losses within ``rtol`` at every step, every tensor of the state within
    ``rtol``/``atol`` at the end, parameters the scheme freezes bit-identical. Returns the state
    before and after, by the source's names.

    ``loss_rtol``, if given, is the losses' tolerance instead of ``rtol``. ``twin``, if given,
    is PyTorch's module (holding the step's initial values) instead of ``model``'s twin.

    ``change_rtol`` compares each tensor's change instead: the L2 norm of (compiled change -
    PyTorch change) within ``change_rtol`` of PyTorch's change's norm, plus ``atol`` per element.
    That is for ReLU6 networks: where a float32 activation lands within an ulp of 0 or 6, TVM and
    PyTorch can fall on opposite sides and pass or block that element's gradient (a 2%
    difference in one depthwise layer's gradient); a wrong update is off by ~100% of it."""
    import torch

    from pipelines.models.pytorch import make_optimizer, selection_of, train_step
    from pipelines.runtime.step import CompiledStep

    twin = twin if twin is not None else twin_of(compiled, model)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    step = CompiledStep(compiled.directory, compiled.initial)
    selection = selection_of(compiled.signature)
    update = make_optimizer(twin, optimizer, selection)
    for batch in batches:
        want = train_step(twin, update, *batch, task=compiled.signature["task"])
        assert step.step(*batch) == pytest.approx(want, rel=loss_rtol or rtol)
    after = step.state_dict()
    for name, value in twin.state_dict().items():
        if name not in after:
            continue  # num_batches_tracked: a fixed momentum never reads it
        if change_rtol is None:
            np.testing.assert_allclose(after[name].numpy(), value.numpy(), rtol=rtol, atol=atol,
                                       err_msg=name)
        else:
            assert_change_close(name, before[name].numpy(), after[name].numpy(), value.numpy(),
                                change_rtol, atol)
        if name not in selection and not name.endswith(("running_mean", "running_var")):
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy(),
                                          err_msg=f"{name} is frozen")
    return before, {k: torch.clone(v) for k, v in after.items()}
