"""The part of a model's section (conf/model/<name>.yaml) every frontend shares; each frontend's
``Config`` adds its own keys and its ``frontend`` tag (pipelines/frontends/__init__.py)."""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from pipelines.data import Data
from pipelines.schema import Strict
from pipelines.tasks import TASKS


class Pretrain(Strict):
    """PyTorch pre-training on the data's pretrain split (SGD or AdamW at a constant learning
    rate), before any case fine-tunes."""

    epochs: PositiveInt
    batch_size: PositiveInt
    lr: PositiveFloat
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: NonNegativeFloat = 0.0
    keep_initial: list[str] = []  # module patterns left at their initial values (a new head)
    kind: Literal["sgd", "adamw"] = "sgd"  # read as an optimizer (models/pytorch.py)
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    eps: PositiveFloat = 1e-8


class Finetune(Strict):
    epochs: PositiveInt
    max_steps: PositiveInt | None = None  # a step count instead of whole epochs
    # the learning rate over the run (evaluate/finetune.py: learning_rate): constant, or
    # cosine decay to 0 after a linear warm-up of warmup_steps, as transformers' cosine
    # schedule with warm-up
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: NonNegativeInt = 0
    # held-out scores every this many steps too (each epoch's end always)
    eval_every: PositiveInt | None = None
    # steps between checkpoints, from which a killed evaluate@ goes on (evaluate/checkpoints.py)
    checkpoint_every: PositiveInt = 100
    # fine-tuning runs from the same initial state, run k shuffling its batches with seed +
    # k: float rounding alone moves one run's accuracy by points (docs/schemes.md), so the
    # metrics give each run's scores and their mean and spread. The first run's weights,
    # curves and export are the case's.
    runs: PositiveInt = 1


class ModelBase(Strict):
    """Where a model comes from and what it is trained on."""

    source: str  # a file (transformers: a directory), relative to the repository root
    batch_size: PositiveInt
    data: Data | None = None  # none: the model is compiled and timed, not trained on data
    pretrain: Pretrain | None = None
    finetune: Finetune | None = None
    blocks: list[str] = []  # module-path patterns of the repeated blocks (files' models)
    # the loss and labels (training/loss.py): classification [B, C] logits, class labels;
    # causal_lm / masked_lm [B, S, V] logits, a token label per position; regression: MSE
    task: Literal[TASKS] = "classification"

    # Whether the model is a PyTorch module: it is exported with torch.export, and PyTorch
    # trains its twin, pre-trains it and times it beside the compiled step.
    in_pytorch: ClassVar[bool] = False
