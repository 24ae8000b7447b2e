"""A PyTorch model from a Python file: ``source`` defines a function ``entry`` that takes the batch
size (and the model's ``kwargs``) and returns the ``nn.Module`` and an example batch of its
inputs, a dict by the names ``forward`` takes:

    def build(batch_size, width=1.0):
        model = MyNet(width)
        return model, {"x": torch.zeros(batch_size, 3, 32, 32)}

The reference models are such files (pipelines/models/). The module is exported with
torch.export in training mode (batch norm uses batch statistics) and lowered by
torch_program.py; its parameters keep their state-dict names.

Or ``source`` is a saved torch.export program (a ``.pt2`` file, no ``entry``): it is lowered as
it is, its parameters keep the program's own names, and PyTorch's side (the twin, the starting
weights) runs the program's graph as a module.

The frontend ``torch`` (pipelines/frontends/__init__.py). The transformers frontend takes the
same path from its module on (``export_module``).
"""
from __future__ import annotations

import inspect
import re
import types
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import model_validator

from pipelines.frontends.base import ModelBase
from pipelines.frontends.python_file import load_file
from pipelines.io import ROOT, write_json_atomic
from pipelines.schema import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: the schema loads without it
    import torch

PROGRAM = ".pt2"  # torch.export.save's files
IMPORTED = "model.pt2"  # the import stage's program (torch and transformers)


class Config(ModelBase):
    """models.<name> with frontend torch: ``source`` a Python file and ``entry`` the function in
    it that builds the model (with ``kwargs``), or a saved torch.export program (.pt2)."""

    frontend: Literal["torch"]
    entry: str | None = None
    kwargs: dict[str, Any] = {}
    in_pytorch: ClassVar[bool] = True

    @model_validator(mode="after")
    def _entry(self):
        if Path(self.source).suffix == PROGRAM:
            given = [k for k in ("entry", "kwargs", "pretrain") if getattr(self, k)]
            if given:
                raise ValueError(f"source {self.source!r} is a saved torch.export program: it "
                                 f"takes no {' or '.join(given)} (entry and kwargs build a model "
                                 "from a Python file; pretrain scores in eval mode, which a "
                                 "program lacks)")
        elif not self.entry:
            raise ValueError("frontend torch needs entry: the function in source that builds "
                             "the model (or a .pt2 program as source)")
        return self


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The frontend's import: the module exported (or the program loaded) with the weights
    stage's ``weights``, as ``model.pt2``, and its layers.json."""
    from pipelines.frontends.layers import describe_program
    from pipelines.frontends.weights import FILE, load_weights

    if not is_program(model):
        return export_module(model, weights, out)
    import torch

    source = ROOT / model.source
    program = with_weights(load_program(source), load_weights(weights / FILE), source)
    check_batch(program, model, source)
    save_program(program, out / IMPORTED)
    write_json_atomic(out / "layers.json", describe_program(program, model.blocks))
    return f"loaded {source.name}: {len(program.graph.nodes)} graph nodes"


def save_program(program, path: Path) -> None:
    """``program`` as torch.export.save writes it, less each node's stack trace: the source
    files' paths on this machine would make the same model's file differ between checkouts."""
    import torch

    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.meta.pop("stack_trace", None)
    torch.export.save(program, path)


def export_module(model, weights: Path, out: Path, load=None) -> str:
    """A PyTorch module (torch or transformers frontend: ``load`` makes it, default
    ``load_module``) with the weights stage's ``weights``, exported with torch.export into
    ``out``, and its layers.json."""
    import torch

    from pipelines.frontends.layers import describe_layers
    from pipelines.frontends.weights import FILE, load_weights

    module, inputs = (load or load_module)(model)
    module.load_state_dict(load_weights(weights / FILE))
    program = export(module, inputs)
    save_program(program, out / IMPORTED)
    write_json_atomic(out / "layers.json", describe_layers(module, model.blocks))
    what = f"{Path(model.source).name}:{model.entry}" if getattr(model, "entry", None) \
        else type(module).__name__
    return f"exported {what}: {len(program.graph.nodes)} graph nodes"


def lower(model, imported: Path):
    """(main, names, origins, initial values) of the imported program (torch and
    transformers)."""
    from pipelines.frontends.torch_program import lower_program

    return lower_program(imported / IMPORTED)


def is_program(model) -> bool:
    """Whether a torch model's ``source`` is a saved torch.export program."""
    return model.frontend == "torch" and Path(model.source).suffix == PROGRAM


def load_module(model: Config) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(module, example inputs) of the model file's ``entry``, freshly initialised (the caller
    seeds torch), or of a saved program (which holds its own weights)."""
    import torch

    path = ROOT / model.source
    if is_program(model):
        program = load_program(path)
        return program_module(program), example_inputs(program, path)
    entry = getattr(load_file(path, "models.<name>.source"), model.entry, None)
    if not callable(entry):
        raise ConfigError(f"{path}: no function {model.entry!r} (models.<name>.entry)")
    try:
        built = entry(model.batch_size, **model.kwargs)
    except TypeError as err:
        raise ConfigError(f"{path}: {model.entry}(batch_size, **kwargs) failed with kwargs "
                          f"{sorted(model.kwargs)}: {err}") from err
    if (not isinstance(built, tuple) or len(built) != 2
            or not isinstance(built[0], torch.nn.Module) or not isinstance(built[1], dict)):
        raise ConfigError(f"{path}: {model.entry}() must return (nn.Module, {{input name: "
                          f"example tensor}}); it returned {type(built).__name__}")
    module, inputs = built
    accepted = list(inspect.signature(module.forward).parameters)
    unknown = [name for name in inputs if name not in accepted]
    if unknown:
        raise ConfigError(f"{path}: example inputs {unknown} are not arguments of "
                          f"{type(module).__name__}.forward{tuple(accepted)}")
    return module, inputs


def export(module: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    """torch.export of ``module`` in training mode, inputs by name in ``forward``'s order."""
    import torch
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from pipelines.frontends.export_rewrites import (drop_unread_grad_blocks,
                                                     refuse_custom_backward, refuse_randomness,
                                                     refuse_untraced_writes, static_masked_rows)

    order = list(inspect.signature(module.forward).parameters)
    ordered = {name: inputs[name] for name in order if name in inputs}
    try:  # an untraced write is refused below, by layer and line, not by torch's message
        with torch._export.config.patch(error_on_lifted_constant_tensors=False), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fake tensor in the exported program")
            program = torch.export.export(module.train(), (), kwargs=ordered)
    except GuardOnDataDependentSymNode as err:
        raise _branches_on_data(module, str(err)) from err
    refuse_untraced_writes(program)
    refuse_randomness(program)  # before saving: a random in-place op does not load back
    refuse_custom_backward(module, ordered, program)
    drop_unread_grad_blocks(program)
    return static_masked_rows(program)


def _branches_on_data(module: torch.nn.Module, message: str) -> ConfigError:
    """The error for a module whose Python control flow reads a tensor's values, at the
    line torch.export names (the user's call, else the frame that guarded)."""
    call = re.search(r"The following call raised this error:\n\s*File \"(.+?)\", line (\d+)"
                     r".*\n\s*(.+)", message)
    cause = re.search(r"Caused by: \((.+?)\)", message)
    where = (f"{call[1]}:{call[2]}: {call[3].strip()}" if call else cause[1] if cause
             else message.splitlines()[0])
    return ConfigError(f"{type(module).__name__} branches on a tensor's values ({where}): a "
                       "compiled step is one graph for every batch, so an if or assert on data "
                       "cannot be traced; use torch.where, or torch._check for an assert")


def load_program(path: Path) -> torch.export.ExportedProgram:
    """The torch.export program saved in ``path`` (a models.<name>.source)."""
    import torch

    if not path.is_file():
        raise ConfigError(f"{path}: no such file (models.<name>.source)")
    try:
        return torch.export.load(path)
    except Exception as err:  # a zip of something else, or from an incompatible torch
        raise ConfigError(f"{path}: not a program torch.export.save wrote "
                          f"(models.<name>.source): {type(err).__name__}: {err}") from err


def example_inputs(program: torch.export.ExportedProgram, path: Path) -> dict[str, torch.Tensor]:
    """The program's example inputs by its input names (positional ones first, as it was
    called)."""
    import torch

    args, kwargs = program.example_inputs or ((), {})
    values = list(args) + list(kwargs.values())
    names = list(program.graph_signature.user_inputs)
    if len(values) != len(names) or not all(isinstance(v, torch.Tensor) for v in values):
        raise ConfigError(f"{path}: the program's inputs {names} must be tensors, one each "
                          "(models.<name>.source)")
    return dict(zip(names, values))


def program_module(program: torch.export.ExportedProgram) -> torch.nn.Module:
    """The program's graph as a module PyTorch trains (the twin, the starting weights), under
    the program's parameter names. Its mode is the one it was exported in: ``train()`` keeps it,
    ``eval()`` is refused (torch.export bakes batch norm's and dropout's mode into the graph)."""
    module = program.module(check_guards=False)

    def train(self, mode: bool = True):
        if not mode:
            raise ConfigError("a saved torch.export program (.pt2) runs in the mode it was "
                              "exported in; it has no eval mode")
        return self

    module.train = types.MethodType(train, module)
    module.eval = types.MethodType(lambda self: train(self, False), module)
    return module


def with_weights(program: torch.export.ExportedProgram, weights: dict[str, torch.Tensor],
                 path: Path) -> torch.export.ExportedProgram:
    """``program`` holding ``weights`` (a state dict under its own names, e.g. the weights
    stage's) instead of the values it was saved with."""
    import torch

    state = program.state_dict
    if set(weights) != set(state):
        raise ConfigError(f"{path}: the weights are not the program's: missing "
                          f"{sorted(set(state) - set(weights))[:5]}, unknown "
                          f"{sorted(set(weights) - set(state))[:5]}")
    for name, value in weights.items():
        if value.shape != state[name].shape or value.dtype != state[name].dtype:
            raise ConfigError(f"{path}: weight {name} is {value.dtype}{list(value.shape)}; "
                              f"the program's is {state[name].dtype}{list(state[name].shape)}")
        kept = value.detach().clone()
        state[name] = torch.nn.Parameter(kept) if isinstance(state[name],
                                                             torch.nn.Parameter) else kept
    return program


def check_batch(program: torch.export.ExportedProgram, model, path: Path) -> None:
    """The program's inputs have the batch size the config says (its shapes are static)."""
    for name, value in example_inputs(program, path).items():
        if value.dim() and value.shape[0] != model.batch_size:
            raise ConfigError(f"{path}: input {name} has batch {value.shape[0]}; "
                              f"models.<name>.batch_size={model.batch_size} must match it")
