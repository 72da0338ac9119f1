"""Per-step scalars of the Adam update, computed once on the host and rounded to fp32.

The eager reference and the Triton kernel both receive exactly these fp32 values, so their arithmetic
starts from the same bits.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass


def f32(x: float) -> float:
    """The nearest fp32 value, as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class AdamScalars:
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

    @classmethod
    def make(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
             decoupled: bool) -> "AdamScalars":
        # Bias corrections in float64 like torch.optim.AdamW's default (non-capturable) path; the second one is
        # applied as a multiplication by its fp32 reciprocal square root (no division per element).
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        return cls(
            beta1=f32(beta1), beta2=f32(beta2), one_minus_beta1=f32(1.0 - beta1), one_minus_beta2=f32(1.0 - beta2),
            eps=f32(eps), weight_decay=f32(weight_decay),
            decay=f32(1.0 - lr * weight_decay) if decoupled else 1.0,
            step_size=f32(lr / bc1), inv_bias_correction2_sqrt=f32(1.0 / math.sqrt(bc2)), decoupled=decoupled,
        )
