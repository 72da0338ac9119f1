"""Per-step scalars of the updates (Adam, SGD, Lion), computed once on the host and rounded to fp32.

The eager reference and the Triton kernel both receive exactly these fp32 values, so their arithmetic
starts from the same bits. The kernel takes ``KERNEL_SLOTS`` fp32 scalar arguments whatever the update; each
class's ``KERNEL_FIELDS`` names the field in each slot (None: unused, passed as 0), and the kernel reads them
back by these names (flashdist/kernels/triton/step.py).

A capturable step computes the same values on the device from a step count and a learning rate held there
(flashdist/kernels/triton/device_scalars.py): every operation below is one IEEE float64 operation, rounded
once to fp32 at the end, and ``power`` raises the betas to the step by repeated squaring, so the device gets
the same bits as the host.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import torch

from ..quant.codes import f32


_PLAIN = frozenset((float, int, bool))

KERNEL_SLOTS = 9


class _KernelArgs:
    KERNEL_FIELDS: tuple[str | None, ...] = ()

    def kernel_args(self) -> tuple[float, ...]:
        """The kernel's fp32 scalar arguments: slot ``k`` holds the field ``KERNEL_FIELDS[k]`` (0.0 if None)."""
        return tuple(0.0 if name is None else getattr(self, name) for name in self.KERNEL_FIELDS)


def power(base: float, n: int) -> float:
    """``base ** n`` in float64 by repeated squaring: the product of ``base^(2^k)`` over the set bits ``k`` of
    ``n``, lowest first, each a single IEEE multiplication, so that the device's copy of this loop
    (device_scalars.py) gives the same bits (a library ``pow`` differs between the host and the GPU in the
    last place)."""
    result, square = 1.0, float(base)
    while n:
        if n & 1:
            result *= square
        square *= square
        n >>= 1
    return result


def _cached(make):
    """Memoise a ``make`` whose arguments are plain Python numbers: gradient release calls it once per FSDP
    group with the same hyper-parameters and step, and each call costs microseconds of fp32 rounding on the
    thread that drives the backward pass. Keyed by the arguments' float64 bits (``-0.0`` and ``0.0``
    differ; every argument, step counts included, is exact as a float64)."""
    cache: dict = {}

    @functools.wraps(make)
    def cached(cls, **kwargs):
        values = kwargs.values()
        if not set(map(type, values)) <= _PLAIN:
            return make(cls, **kwargs)
        key = (cls, *kwargs, struct.pack(f"{len(values)}d", *values))
        hit = cache.get(key)
        if hit is None:
            if len(cache) >= 256:
                cache.clear()
            hit = cache[key] = make(cls, **kwargs)
        return hit

    return cached


@dataclass(frozen=True)
class AdamScalars(_KernelArgs):
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    weight_decay: float
    decay: float  # 1 - lr * weight_decay (decoupled only)
    step_size: float  # lr / (1 - beta1^t)
    inv_bias_correction2_sqrt: float  # 1 / sqrt(1 - beta2^t): the step multiplies sqrt(v) by it
    decoupled: bool

    KERNEL_FIELDS = ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "weight_decay", "decay",
                     "step_size", "inv_bias_correction2_sqrt")

    @classmethod
    @_cached
    def make(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
             decoupled: bool) -> "AdamScalars":
        # Bias corrections in float64 like torch.optim.AdamW's default (non-capturable) path (the powers by
        # repeated squaring: ``power``); the second one is applied as a multiplication by its fp32 reciprocal
        # square root (no division per element).
        bc1 = 1.0 - power(beta1, step)
        bc2 = 1.0 - power(beta2, step)
        return cls(
            beta1=f32(beta1), beta2=f32(beta2), one_minus_beta1=f32(1.0 - beta1), one_minus_beta2=f32(1.0 - beta2),
            eps=f32(eps), weight_decay=f32(weight_decay),
            decay=f32(1.0 - lr * weight_decay) if decoupled else 1.0,
            step_size=f32(lr / bc1), inv_bias_correction2_sqrt=f32(1.0 / math.sqrt(bc2)), decoupled=decoupled,
        )


@dataclass(frozen=True)
class SGDScalars(_KernelArgs):
    """SGD with momentum, as ``torch.optim.SGD``: ``buf = momentum * buf + (1 - dampening) * g``, except at
    the first step, where the buffer starts as the gradient itself (``momentum_decay`` 0, ``momentum_gain``
    1); the step moves by ``buf`` or, with Nesterov, by ``g + momentum * buf``."""

    momentum_decay: float  # factor of the stored buffer: momentum, 0 at the first step
    momentum_gain: float  # factor of the gradient: 1 - dampening, 1 at the first step
    momentum: float  # Nesterov's look-ahead factor
    weight_decay: float
    decay: float  # 1 - lr * weight_decay (decoupled only)
    lr: float
    decoupled: bool
    nesterov: bool

    KERNEL_FIELDS = ("momentum_decay", "momentum", "momentum_gain", None, None, "weight_decay", "decay", "lr", None)

    @classmethod
    @_cached
    def make(cls, *, lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool, step: int,
             decoupled: bool) -> "SGDScalars":
        first = step == 1
        return cls(
            momentum_decay=0.0 if first else f32(momentum), momentum_gain=1.0 if first else f32(1.0 - dampening),
            momentum=f32(momentum), weight_decay=f32(weight_decay),
            decay=f32(1.0 - lr * weight_decay) if decoupled else 1.0, lr=f32(lr), decoupled=decoupled,
            nesterov=nesterov,
        )


@dataclass(frozen=True)
class LionScalars(_KernelArgs):
    """Lion (Chen et al., 2023): ``theta -= lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m = beta2 * m + (1 - beta2) * g``; weight decay decoupled (``decay = 1 - lr * weight_decay``)."""

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    decay: float
    lr: float

    KERNEL_FIELDS = ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", None, None, "decay", "lr", None)

    @classmethod
    @_cached
    def make(cls, *, lr: float, beta1: float, beta2: float, weight_decay: float) -> "LionScalars":
        return cls(beta1=f32(beta1), beta2=f32(beta2), one_minus_beta1=f32(1.0 - beta1),
                   one_minus_beta2=f32(1.0 - beta2), decay=f32(1.0 - lr * weight_decay), lr=f32(lr))


@dataclass(frozen=True)
class DeviceScalars:
    """The kernel slots of a capturable step: an fp32 ``(KERNEL_SLOTS,)`` tensor on the device, written there
    by ``flashdist.kernels.triton.device_scalars`` (the same bits as the host classes above), with what the
    launch decides on the host from values that do not change between steps: Adam's eps and the largest
    ``1 / sqrt(1 - beta2^t)`` (the first step's), which bound the update's range (``FAST_UPDATE``)."""

    values: torch.Tensor
    decoupled: bool
    nesterov: bool = False
    eps: float = 0.0
    inv_bias_correction2_sqrt: float = 0.0


@dataclass(frozen=True)
class MuonScalars:
    """Muon (torch.optim.Muon's update) on one matrix: the momentum ``buf.lerp_(g, 1 - momentum)``, the
    Nesterov look-ahead ``g.lerp(buf, momentum)``, the decoupled decay ``1 - lr * weight_decay`` and the
    step ``-adjusted_lr``, each rounded to fp32 as torch's CPU and CUDA kernels take a Python scalar
    (``lr * weight_decay`` and the adjustment in float64 first, as torch computes them in Python)."""

    buffer_weight: float  # 1 - momentum: the lerp weight of the gradient into the buffer
    momentum: float  # Nesterov's lerp weight of the buffer
    decay: float  # 1 - lr * weight_decay
    alpha: float  # -adjusted_lr of this matrix
    nesterov: bool

    @classmethod
    @_cached
    def make(cls, *, lr: float, weight_decay: float, momentum: float, nesterov: bool,
             lr_ratio: float) -> "MuonScalars":
        return cls(buffer_weight=f32(1.0 - momentum), momentum=f32(momentum), decay=f32(1.0 - lr * weight_decay),
                   alpha=f32(-(lr * lr_ratio)), nesterov=nesterov)


def muon_lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment of a (rows, cols) matrix: ``"original"`` (None)
    ``sqrt(max(1, rows / cols))`` (Keller Jordan's), ``"match_rms_adamw"`` ``0.2 * sqrt(max(rows, cols))``
    (Moonshot's: reuse AdamW's lr and weight decay). A matrix with no columns has no update to scale: 1
    (torch.optim.Muon divides by zero there)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols)) if cols else 1.0
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"flashdist: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
