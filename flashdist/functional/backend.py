"""Which implementation a functional step runs: the Triton kernel, the fused CPU step or the eager reference."""

from __future__ import annotations

import os

import torch

from .._compat import HAS_TRITON
from ..kernels import cpu

BACKENDS = ("auto", "triton", "cpu", "reference")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: the Triton kernel for CUDA tensors when triton is importable, the fused CPU step
    (``flashdist.kernels.cpu``) for CPU tensors unless ``FLASHDIST_CPU_KERNEL=0``, else the eager reference.
    The CPU step is built at its first use; where it cannot be, or the tensors are not ones it handles, the
    call runs the reference (``backend="cpu"`` makes that an error instead). While torch.compile traces a
    step, ``auto`` gives the reference, which it can trace."""
    if backend not in BACKENDS:
        raise ValueError(f"flashdist: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda" and HAS_TRITON:
            return "triton"
        if device.type == "cpu" and cpu.enabled() and not torch.compiler.is_compiling():
            return "cpu"
        return "reference"
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError("flashdist: backend='triton' needs the triton package (pip install triton)")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"flashdist: backend='triton' runs on CUDA tensors and these are on {device}: use "
                         "backend='auto' (TRITON_INTERPRET=1 runs the kernels on the CPU, slowly, for tests)")
    return backend


def cpu_fallback(backend: str, done: bool) -> bool:
    """After a fused CPU step returned ``done``: True when the reference must run instead (``auto``), an error
    when the caller asked for ``backend="cpu"``."""
    if done:
        return False
    if backend == "cpu":
        why = cpu.build_error() or "the tensors are not contiguous CPU tensors of the supported dtypes"
        raise RuntimeError(f"flashdist: backend='cpu' could not run the fused CPU step ({why}); use "
                           "backend='auto' to fall back to the eager reference")
    return True


def on_device(value, device: torch.device) -> bool:
    """Whether ``value`` (a step count or learning rate) is a one-element tensor on ``device``: a CUDA step then
    computes its scalars there (``flashdist.kernels.triton.device_scalars``), which lets a CUDA graph capture it."""
    return isinstance(value, torch.Tensor) and value.device == device and value.numel() == 1


def host_number(value) -> float:
    """A step count or learning rate on the host as a Python number (a tensor is read: one synchronisation
    where it is on a GPU; a NumPy scalar, which torch.optim takes too, converted)."""
    if isinstance(value, (int, float)):
        return value
    return value.item() if hasattr(value, "item") else float(value)  # (a tensor, a NumPy scalar; a Fraction)
