"""Imports whose load-time warnings say nothing about a run, made quietly. torchao (installed
by executorch; imported by peft, and by transformers' torchao quantizer when a model loads)
logs a warning for each CUDA kernel library a CPU-only torch cannot load, and torch one for
each of torchao's enums it registers."""
from __future__ import annotations

import importlib
import logging

LOGGERS = ("torchao", "torch.utils._pytree")  # where those warnings are logged


def quiet_import(name: str):
    """The module ``name``, imported with LOGGERS' warnings off (errors still logged)."""
    loggers = [logging.getLogger(logger) for logger in LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
