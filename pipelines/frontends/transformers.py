"""Hugging Face ``transformers`` models as users keep them: ``source`` is a local directory as
``save_pretrained`` writes it (config.json and safetensors weights: a downloaded model), or a
directory or config.json with the config alone (random initialisation, seeded by the caller).
``architecture`` names the class, e.g. ``LlamaForCausalLM``, or an ``AutoModel*`` class for
the config's family (``AutoModelForCausalLM``; default: the config's own ``architectures``),
and ``config`` overrides keys of config.json (``num_labels``, a smaller
``num_hidden_layers``); a head the checkpoint lacks starts from its seeded initialisation, as
``from_pretrained`` does.

The module then goes through the PyTorch path (torch.export, torch_program.py) under its own
state-dict names (``model.layers.0.self_attn.q_proj.weight``), so schemes, LoRA and the twin
read the names the model card shows. Its ``forward`` takes the step's inputs (``inputs``: the
model's main input, ``input_ids`` or ``pixel_values``, unless the config lists others, e.g. an
attention mask) and returns the logits alone. The fine-tuned weights go back as a directory
``from_pretrained`` loads (``save_pretrained``).

A training step is deterministic, so dropout and stochastic depth are off (every
``*dropout*``, ``*pdrop*``, ``*drop_path*`` or ``*drop_rate*`` probability of the config set to
0, a per-stage list too), and so is the key-value cache.

The frontend ``transformers`` (pipelines/frontends/__init__.py).
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import PositiveInt

from pipelines.frontends import torch_module
from pipelines.frontends.base import ModelBase
from pipelines.io import ROOT
from pipelines.schema import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: the schema loads without it
    import torch


class Config(ModelBase):
    """models.<name> with frontend transformers: ``source`` a save_pretrained directory (or a
    config.json); the class, config overrides and the step's inputs by name."""

    frontend: Literal["transformers"]
    architecture: str | None = None  # default: config.json's ``architectures``
    config: dict[str, Any] = {}  # keys of config.json to override
    inputs: list[str] = []  # default: the model's main input
    dims: dict[str, PositiveInt] = {}  # input sizes the data does not give (sequence, ...)
    in_pytorch: ClassVar[bool] = True


def import_model(model: Config, weights: Path, out: Path) -> str:
    """The module with the weights stage's ``weights``, exported with torch.export."""
    return torch_module.export_module(model, weights, out, load_module)


lower = torch_module.lower

CONFIG = "config.json"
# Inputs a step can feed a transformers model, and how an example of each is made.
EXAMPLES = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")
# a config's probabilities of randomness in training: dropout, stochastic depth, drop-connect
RANDOM = ("dropout", "pdrop", "drop_path", "drop_rate", "drop_connect")


def _library():
    from pipelines.quiet import quiet_import

    # imported quietly before a model loads them: the torchao quantizer imports torchao
    quiet_import("transformers.quantizers")
    return quiet_import("transformers")


def config_of(model):
    """The model's PretrainedConfig: config.json from ``source`` with ``config`` on top,
    dropout, stochastic depth and the key-value cache off."""
    transformers = _library()
    path = ROOT / model.source
    file = path / CONFIG if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{path}: no {CONFIG} (models.<name>.source: a directory as "
                          "save_pretrained writes it, or a config.json)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(file.parent if path.is_dir()
                                                             else file))
    except (ValueError, OSError) as err:
        raise ConfigError(f"{file}: not a transformers config: {err}") from err
    unknown = sorted(k for k in model.config if not hasattr(config, k))
    if unknown:  # num_labels is a property (of id2label), not a key of the dict
        raise ConfigError(f"models.<name>.config has keys {unknown} that {type(config).__name__} "
                          f"does not; allowed: {sorted({*config.to_dict(), 'num_labels'})}")
    if model.config:
        values = config.to_dict()
        if "num_hidden_layers" in model.config:  # per-layer lists (Qwen2's layer_types) follow
            layers = values.get("num_hidden_layers")
            values = {k: v for k, v in values.items() if k == "architectures" or k in model.config
                      or not (isinstance(v, list) and len(v) == layers)}
        if model.config.get("num_labels", config.num_labels) != config.num_labels:
            values = {k: v for k, v in values.items() if k not in ("id2label", "label2id")}
        config = type(config).from_dict({**values, **model.config})
    _randomness_off(config, transformers.PretrainedConfig)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    # Mixture-of-experts layers: each token's experts' weights gathered and applied as batched
    # products, static shapes that export and differentiate; the default (grouped_mm) sorts
    # tokens by expert into runtime-sized groups, which TVM's importer cannot convert.
    config._experts_implementation = "batched_mm"
    return config


def _randomness_off(config, config_class):
    """Dropout and stochastic depth off in ``config`` and its sub-configs (Emu3's text model)."""
    for key, value in config.to_dict().items():
        current = getattr(config, key, None)
        if isinstance(current, config_class):
            _randomness_off(current, config_class)
        elif any(part in key for part in RANDOM):
            if isinstance(value, float):
                setattr(config, key, 0.0)
            elif isinstance(value, list) and all(isinstance(v, float) for v in value):
                setattr(config, key, [0.0] * len(value))  # CvT's rate per stage


def data_source(model):
    """The model directory's tokenizer, the config's vocabulary size, its image
    preprocessing (preprocessor_config.json, and the config's image_size), and a
    classifier's num_labels."""
    from pipelines.data import Source

    config = config_of(model)
    path = ROOT / model.source
    directory = path if path.is_dir() else path.parent
    preprocessor = directory / "preprocessor_config.json"
    settings = json.loads(preprocessor.read_text()) if preprocessor.is_file() else {}
    if getattr(config, "image_size", None):
        settings.setdefault("image_size", config.image_size)
    classes = config.num_labels if model.task == "classification" else None
    return Source(directory, getattr(config.get_text_config(), "vocab_size", None), settings,
                  classes, "config.num_labels")


def class_of(model, config) -> type:
    """The transformers class ``architecture`` (or the config's ``architectures``) names."""
    transformers = _library()
    name = model.architecture or (config.architectures or [None])[0]
    if name is None:
        raise ConfigError(f"{model.source}: the config names no architecture; set "
                          "models.<name>.architecture, e.g. LlamaForSequenceClassification")
    cls = getattr(transformers, name, None)
    if name.startswith("AutoModel") and cls is not None:  # the config's family's class
        try:
            cls = cls._model_mapping[type(config)]
        except KeyError:
            raise ConfigError(f"models.<name>.architecture={name}: {type(config).__name__} "
                              f"has no such class") from None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        family = name.split("For")[0]
        near = sorted(n for n in dir(transformers) if n.startswith(family) and "For" in n)
        raise ConfigError(f"models.<name>.architecture={name!r} is not a transformers model "
                          f"class; {'allowed for ' + family + ': ' + str(near) if near else ''}")
    return cls


def has_weights(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def _logits_only(module: torch.nn.Module, inputs: list[str]) -> torch.nn.Module:
    """``module`` whose forward takes ``inputs`` (by position or name) and returns the logits:
    its class becomes a subclass of its own, so its parameters keep their names."""
    cls = type(module)

    def forward(self, *args, **kwargs):
        given = dict(zip(inputs, args)) | kwargs
        return cls.forward(self, **given, return_dict=True).logits

    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = inspect.Signature(
        [self] + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in inputs])
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward,
                                                   "__module__": cls.__module__})
    return module


def input_names(model, module) -> list[str]:
    """The step's inputs: those ``inputs`` binds, or the model's main input."""
    names = list(model.inputs) or [module.main_input_name]
    accepted = inspect.signature(type(module).forward).parameters
    bad = [n for n in names if n not in EXAMPLES or n not in accepted]
    if bad:
        raise ConfigError(f"models.<name>.inputs has {bad}; allowed for "
                          f"{type(module).__name__}: "
                          f"{[n for n in EXAMPLES if n in accepted]}")
    return names


def _size(model, key: str, *fallbacks) -> int:
    """A dimension of the example inputs: ``dims.<key>``, else the first fallback given."""
    for value in (model.dims.get(key), *fallbacks):
        if value:
            return int(value)
    raise ConfigError(f"the size of the model's inputs is not known: set "
                      f"models.<name>.dims.{key} (or give the model data that has it)")


def example_inputs(model, config, names: list[str]) -> dict[str, torch.Tensor]:
    """An example batch of each input (token ids above 0, a full mask, one token type,
    normal pixels), at ``batch_size`` and the sizes ``dims`` or the data give."""
    import torch

    data, batch, examples = model.data, model.batch_size, {}
    for name in names:
        if name == "pixel_values":
            size = _size(model, "image_size", getattr(data, "image_size", None),
                         getattr(config, "image_size", None))
            channels = getattr(config, "num_channels", 3)
            examples[name] = torch.randn(batch, channels, size, size)
            continue
        seq = _size(model, "sequence", getattr(data, "seq_len", None))
        text = config.get_text_config()  # a multimodal model's text settings are its own
        longest = getattr(text, "max_position_embeddings", None)
        if longest and longest > 0 and seq > longest:  # XLNet's -1: relative, no limit
            raise ConfigError(f"models.<name>.dims.sequence={seq} is longer than the model's "
                              f"max_position_embeddings ({longest}); allowed: 1..{longest}")
        if name == "input_ids":
            # a character model (CANINE) has no vocabulary: it reads code points, ASCII's here
            examples[name] = torch.randint(1, getattr(text, "vocab_size", 128), (batch, seq))
        elif name == "attention_mask":
            examples[name] = torch.ones(batch, seq, dtype=torch.int64)
        else:
            examples[name] = torch.zeros(batch, seq, dtype=torch.int64)
    return examples


def load_module(model) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(module, example inputs) of a Model of frontend transformers: the checkpoint's weights
    where ``source`` has them, else a seeded initialisation (the caller seeds torch)."""
    config = config_of(model)
    cls = class_of(model, config)
    config = _for_class(cls, config)
    path = ROOT / model.source
    if has_weights(path):
        module = cls.from_pretrained(str(path), config=config)
    else:
        module = cls(config)
    names = input_names(model, module)
    return _logits_only(module.train(), names), example_inputs(model, config, names)


def _for_class(cls: type, config):
    """``config``, or its text config where the class is a text model's and ``config`` a
    multimodal one's (transformers maps Qwen3.5's composite config to its causal LM)."""
    wanted = getattr(cls, "config_class", None)
    text = config.get_text_config()
    if wanted and not isinstance(config, wanted) and isinstance(text, wanted):
        return text
    return config


def own_loss_task(module, inputs: dict, labels) -> str | None:
    """The step's task whose loss is the class's own language-model loss (``labels=``):
    ``causal_lm`` where it predicts the next token (shifts the labels, as LLaMA's does),
    ``masked_lm`` where it predicts the token at each position (BART's, Blenderbot's and
    TrOCR's decoders), None where it is neither cross entropy of its logits (ProphetNet's
    n-gram streams); read off one forward pass on ``inputs``."""
    import torch

    with torch.no_grad():
        base = type(module).__mro__[1]  # the class itself, under _logits_only's subclass
        out = base.forward(module, **inputs, labels=labels, return_dict=True)
        vocab = out.logits.shape[-1]
        cross = torch.nn.functional.cross_entropy
        losses = {"causal_lm": cross(out.logits[:, :-1].reshape(-1, vocab),
                                     labels[:, 1:].reshape(-1)),
                  "masked_lm": cross(out.logits.reshape(-1, vocab), labels.reshape(-1))}
    task = min(losses, key=lambda t: abs(float(out.loss - losses[t])))
    return task if abs(float(out.loss - losses[task])) <= 1e-4 * abs(float(out.loss)) else None


def pretrained_module(model, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model's transformers class holding ``state`` (the step's weights by the model's
    names; a tied head, GPT-2's or BERT's, is one tensor of the step, one name), to be saved:
    built on the meta device, so buffers that are not saved (rotary frequencies) stay unset."""
    import torch

    config = config_of(model)
    cls = class_of(model, config)
    config = _for_class(cls, config)
    with torch.device("meta"):
        module = cls(config)
    module.load_state_dict(state, strict=False, assign=True)
    module.tie_weights()
    missing = [n for n, p in module.state_dict().items() if p.is_meta]
    if missing:
        raise KeyError(f"the fine-tuned state holds no value for {missing[:5]}")
    module.config.architectures = [cls.__name__]
    return module.eval()


def save_pretrained(model, state: dict[str, torch.Tensor], directory: Path,
                    classes: list[str] | None = None) -> None:
    """``state`` (the step's weights by the model's names) into ``directory`` as a checkpoint
    ``from_pretrained`` loads: config.json (the config the step was built with; a
    classifier's ``classes``, its labels' names, as id2label) and model.safetensors."""
    module = pretrained_module(model, state)
    if classes is not None and len(classes) == module.config.num_labels:
        module.config.id2label = dict(enumerate(classes))
        module.config.label2id = {name: i for i, name in enumerate(classes)}
    module.save_pretrained(str(directory))
