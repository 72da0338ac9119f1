"""Optimizer classes: param groups, hyper-parameters and state lifecycle."""

from .adam import FlashAdam, FlashAdamW
from .base import FlashOptimizer
from .layout import LayoutOptions
from .lion import FlashLion
from .muon import FlashMuon, muon_param_groups
from .precision import PrecisionWarning
from .sgd import FlashSGD, FlashSGDW

__all__ = ["FlashAdam", "FlashAdamW", "FlashLion", "FlashMuon", "FlashOptimizer", "FlashSGD", "FlashSGDW", "LayoutOptions",
           "PrecisionWarning", "muon_param_groups"]
