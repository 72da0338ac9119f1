"""Weight splitting: an fp32 master weight kept as a bf16/fp16 parameter plus an integer correction ``rho``.

``theta' = round_to_nearest(theta)`` is the parameter the model computes with. The rounding error is at
most half the spacing of ``theta'``'s format at ``theta'``; ``rho`` stores it in units of that half-spacing:
``rho = round(127 * (theta - theta') / (ulp(theta') / 2))`` as int8 (``master_weight_bits=24``), or
``32767 * ...`` as int16 (32). Rebuilding: ``theta = theta' + rho * (ulp(theta') / 2) / 127``.

Budget: 1 byte per parameter for 24-bit, 2 for 32-bit. Error of the rebuilt weight: at most half a rho
step, ``(ulp/2) / 254``. For bf16 + int8 that is ``2^-16 * 128/127`` relative to ``|theta|`` at worst (just
above a power of two; int8's 255 symmetric levels cannot cover ``[-ulp/2, ulp/2]`` in steps of exactly
``ulp/256``), about ``2^-16.01``; ``2^-24 * 32768/32767`` for bf16 + int16; fp16 parameters have three
more mantissa bits and do 8x better. Normal-range values only: subnormal parameters have a fixed spacing.
"""

from __future__ import annotations

import torch

from ..kernels.scalars import f32

# format -> (number of explicit mantissa bits, smallest normal biased fp32 exponent of the format)
_FORMATS = {torch.bfloat16: (7, 1), torch.float16: (10, 127 - 14)}
RHO_DTYPES = {24: torch.int8, 32: torch.int16}
RHO_MAX = {torch.int8: 127, torch.int16: 32767}
RHO_INV = {dt: f32(1.0 / lim) for dt, lim in RHO_MAX.items()}


def splits(param_dtype: torch.dtype, master_weight_bits: int | None) -> bool:
    """True when a parameter of this dtype keeps a rho correction under this setting."""
    return master_weight_bits is not None and param_dtype in _FORMATS


def rho_dtype(master_weight_bits: int) -> torch.dtype:
    return RHO_DTYPES[master_weight_bits]


def half_ulp(x: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``param_dtype`` at each fp32 value ``x`` (which must be exactly representable)."""
    mbits, min_exp = _FORMATS[param_dtype]
    exp = ((x.view(torch.int32) >> 23) & 0xFF).clamp_min(min_exp)
    return (exp << 23).view(torch.float32) * (2.0 ** -(mbits + 1))


def merge(param: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp32 master weight from the low-precision parameter and its correction."""
    tp = param.float()
    return tp + (rho.float() * half_ulp(tp, param.dtype)) * RHO_INV[rho.dtype]


def split(theta: torch.Tensor, param_dtype: torch.dtype, rho_dtype: torch.dtype):
    """fp32 master weight -> (parameter in ``param_dtype``, rho)."""
    low = theta.to(param_dtype)
    tp = low.float()
    return low, round_rho((theta - tp) / half_ulp(tp, param_dtype) * float(RHO_MAX[rho_dtype]), rho_dtype)


def round_rho(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round half away from zero and clamp; an overflowed parameter (inf) gets rho 0."""
    lim = float(RHO_MAX[dtype])
    q = torch.where(torch.isfinite(q), q, torch.zeros_like(q))
    return torch.floor(q.abs() + 0.5).copysign(q).clamp(-lim, lim).to(dtype)
