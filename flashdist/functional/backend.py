"""Which implementation a functional step runs: the Triton kernel or the eager torch reference."""

from __future__ import annotations

import torch

from .._compat import HAS_TRITON

BACKENDS = ("auto", "triton", "reference")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: the Triton kernel for CUDA tensors when triton is importable, else the eager reference."""
    if backend not in BACKENDS:
        raise ValueError(f"flashdist: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "reference"
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("flashdist: backend='triton' needs the triton package (pip install triton)")
    return backend
