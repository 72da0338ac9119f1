"""Optimizer classes: param groups, hyper-parameters and state lifecycle."""

from .adam import FlashAdam, FlashAdamW
from .base import FlashOptimizer, PrecisionWarning
from .lion import FlashLion
from .sgd import FlashSGD, FlashSGDW

__all__ = ["FlashAdam", "FlashAdamW", "FlashLion", "FlashOptimizer", "FlashSGD", "FlashSGDW", "PrecisionWarning"]
