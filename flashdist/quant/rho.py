"""Weight splitting: an fp32 master weight kept as a bf16/fp16 parameter plus an integer correction ``rho``.

``theta'`` is the parameter the model computes with: ``theta`` rounded to the nearest bf16/fp16 value.
``h = ulp(theta') / 2`` is half the format's spacing there (toward zero from a power of two, the
spacing is half as wide and ``h`` is taken on that side), so ``|theta - theta'| <= h``. rho stores that
error in steps of ``h / 2^(k-1)``: ``rho = round((theta - theta') / h * 2^(k-1))`` with ``k`` = 8 bits
(int8, ``master_weight_bits=24``) or 16 (int16, 32). Rebuilding: ``theta = theta' + rho * h / 2^(k-1)``.
The rounding is half away from zero OF ``theta`` (a tie moves the rebuilt weight away from zero, whichever
side of ``theta'`` it is on).

All of it is exact fp32 arithmetic (``h`` and the step are powers of two), so the eager code here and the
Triton kernel agree bit for bit. Two's-complement ints hold one more negative value than positive, so the
error range ``[-h, h]`` is covered as ``[-2^(k-1), 2^(k-1) - 1]``: when the error rounds to ``+2^(k-1)``
(``theta`` within half a step of the midpoint above ``theta'``) the split takes the next value up as
``theta'`` and a rho of ``-2^(k-1)``. Hence:

- for bf16 this is: ``theta`` rounded half away from zero to the fp32 values whose low 8 bits are zero
  (int8: a 24-bit float with fp32's exponent and 15 explicit mantissa bits; int16: fp32 itself, no
  rounding), split into the nearest bf16 value (ties toward +inf) and the remainder in rho steps. The
  Triton kernel computes it that way, on integers.
- error of the rebuilt weight at most half a step, ``h / 2^k``: ``2^-16`` relative to ``|theta|`` for
  bf16 + int8 (bf16 has 8 significant bits: ``h <= 2^-8 |theta|``), ``2^-19`` for fp16 + int8;
  none for bf16 + int16 (every fp32 value is reachable); fp16 + int16 adds one fp32 rounding of the sum.
  Normal-range values; subnormal parameters have a fixed absolute spacing.
- the parameter is ``theta`` rounded to nearest, except in those half-step windows next to a midpoint,
  where it is the other neighbour (at most one ulp away, as round-to-nearest allows at the midpoint).
- ``merge(p, 0)`` is ``p``, a negative zero included, and ``split(merge(p, rho))`` gives back ``(p, rho)``
  for 24-bit, so an fp32 export re-imports exactly.
- an infinite or NaN parameter gets rho 0 from ``split`` and stays as it is in ``merge``.

Budget: 1 byte per parameter for 24-bit, 2 for 32-bit.
"""

from __future__ import annotations

import torch

# format -> (number of explicit mantissa bits, smallest normal biased fp32 exponent of the format)
_FORMATS = {torch.bfloat16: (7, 1), torch.float16: (10, 127 - 14)}
RHO_DTYPES = {24: torch.int8, 32: torch.int16}
MASTER_WEIGHT_BITS_OF = {dtype: bits for bits, dtype in RHO_DTYPES.items()}  # the masters a rho dtype makes
RHO_STEPS = {torch.int8: 128.0, torch.int16: 32768.0}  # 2^(k-1): steps per h


def splits(param_dtype: torch.dtype, master_weight_bits: int | None) -> bool:
    """True when a parameter of this dtype keeps a rho correction under this setting."""
    return master_weight_bits is not None and param_dtype in _FORMATS


def rho_dtype(master_weight_bits: int) -> torch.dtype:
    return RHO_DTYPES[master_weight_bits]


# floating dtypes that hold every value of each rho dtype exactly (what a torch optimizer's load_state_dict
# casts rho to: the parameter's dtype)
EXACT_CASTS = {torch.int8: (torch.bfloat16, torch.float16, torch.float32, torch.float64),
               torch.int16: (torch.float32, torch.float64)}


def from_float(value: torch.Tensor, rho_dtype: torch.dtype) -> torch.Tensor | None:
    """rho of ``rho_dtype`` back from a floating cast of it (a state dict that went through a torch optimizer),
    or None where no such cast gives ``value``: a dtype that does not hold every ``rho_dtype`` value, or values
    that are not whole numbers in its range."""
    if value.dtype not in EXACT_CASTS.get(rho_dtype, ()):
        return None
    info = torch.iinfo(rho_dtype)
    if not bool(torch.all((value == value.round()) & (value >= info.min) & (value <= info.max))):
        return None
    return value.to(rho_dtype)


def half_ulp(x: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``param_dtype`` at each fp32 value ``x`` (exactly representable), away from zero;
    at an infinite or NaN ``x`` that of the largest binade, so that ``merge`` leaves such a parameter as it
    is (``inf + rho * h`` is ``inf``)."""
    mbits, min_exp = _FORMATS[param_dtype]
    exp = ((x.view(torch.int32) >> 23) & 0xFF).clamp(min_exp, 254)
    return (exp << 23).view(torch.float32) * (2.0 ** -(mbits + 1))


def rho_unit(tp: torch.Tensor, toward_zero: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """``h``, the half-spacing that rho counts in: at a power of two the spacing toward zero is half the
    spacing away from zero, and using it there keeps the error below ``2^-16 |theta|`` on both sides."""
    _, min_exp = _FORMATS[param_dtype]
    bits = tp.view(torch.int32)
    pow2 = ((bits & 0x7FFFFF) == 0) & (((bits >> 23) & 0xFF) > min_exp)
    h = half_ulp(tp, param_dtype)
    return torch.where(pow2 & toward_zero, h * 0.5, h)


def merge(param: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp32 master weight from the low-precision parameter and its correction."""
    tp = param.float()
    r = rho.float()
    toward_zero = ((r < 0) & (tp > 0)) | ((r > 0) & (tp < 0))
    # h / 2^(k-1) first: a power of two, exact (at least 2^-149), and rho times it cannot overflow
    merged = tp + r * (rho_unit(tp, toward_zero, param.dtype) * (1.0 / RHO_STEPS[rho.dtype]))
    return torch.where(rho == 0, tp, merged)  # rho 0 is the parameter itself, -0 included (-0 + 0 is +0)


def _code(theta: torch.Tensor, tp: torch.Tensor, param_dtype: torch.dtype, steps: float):
    err = theta - tp
    h = rho_unit(tp, ((err < 0) & (tp > 0)) | ((err > 0) & (tp < 0)), param_dtype)
    q = err / h * steps  # exact: a scaling by a power of two
    # rounded half away from zero of theta: in the direction of |theta|, half up
    sign = torch.where(torch.signbit(theta), -1.0, 1.0)
    return torch.floor(q * sign + 0.5) * sign, h


def split(theta: torch.Tensor, param_dtype: torch.dtype, rho_dtype: torch.dtype):
    """fp32 master weight -> (parameter in ``param_dtype``, rho)."""
    steps = RHO_STEPS[rho_dtype]
    tp = theta.to(param_dtype).float()
    r, h = _code(theta, tp, param_dtype, steps)
    up = r >= steps  # past the last positive code: use the next value up, and a negative rho
    tp = torch.where(up, (tp + 2.0 * h).copysign(theta), tp)  # (a zero parameter keeps theta's sign)
    r = torch.where(up, _code(theta, tp, param_dtype, steps)[0], r)
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))  # an overflowed parameter (inf) gets rho 0
    return tp.to(param_dtype), r.clamp(-steps, steps - 1).to(rho_dtype)
