"""Keyword-only functional optimizer steps on lists of plain local tensors."""

from .adam import flash_adam
from .backend import BACKENDS, resolve_backend
from .lion import flash_lion
from .muon import flash_muon
from .sgd import flash_sgd

__all__ = ["BACKENDS", "flash_adam", "flash_lion", "flash_muon", "flash_sgd", "resolve_backend"]
