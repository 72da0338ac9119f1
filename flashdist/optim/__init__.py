"""Optimizer classes: param groups, hyper-parameters and state lifecycle."""

from .adam import FlashAdam, FlashAdamW
from .base import FlashOptimizer

__all__ = ["FlashAdam", "FlashAdamW", "FlashOptimizer"]
