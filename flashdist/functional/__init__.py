"""Keyword-only functional optimizer steps on lists of plain local tensors."""

from .adam import flash_adam, resolve_backend

__all__ = ["flash_adam", "resolve_backend"]
