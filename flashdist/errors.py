"""Exceptions of flashdist that callers may want to tell apart from others."""

from __future__ import annotations


class CaptureRefused(RuntimeError):
    """An optimizer step being captured in a CUDA graph would need host work that a graph cannot replay (a new
    launch plan, gradients at new addresses, step counts read on the host, an optimizer that is not capturable).
    Raised before the step changes anything; ``flashdist.GraphedStep`` then steps eagerly instead, and tries
    again once something changes (``retry``: at its next call, for what depends on this call's gradients)."""

    def __init__(self, message: str, *, retry: bool = False):
        super().__init__(message)
        self.retry = retry
