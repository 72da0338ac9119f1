"""Group-wise 8-bit codes for optimizer moments (eager torch; the numerical definition).

Layout. A parameter of two or more dims is viewed as ``(rows, cols)`` with ``rows = shape[0]`` and
``cols = numel // rows``. A quantization group is up to ``GROUP = 32`` consecutive values of ONE row;
groups never cross a row, so a dim-0 shard (FSDP2's ``Shard(0)``) never splits a group. Codes have the
parameter's shape; scales have shape ``(rows, ceil(cols / 32))`` and shard on dim 0 like the parameter.

Codes.
- first moment ``m``: int8. ``x = m / s`` in [-1, 1], softsign companding ``y = 2x / (1 + |x|)``,
  code ``round(127 y)``; inverse ``y = code / 127``, ``x = y / (2 - |y|)``.
- second moment ``v``: uint8 of ``u = sqrt(v)``: ``code = round(255 u / s)``, ``v = (code / 255 * s)^2``.
- ``companded=False`` (the paper's ablation): ``m`` linear int8, ``v`` linear uint8 without the sqrt.

Scales are bfloat16 group absmax values: 2 bytes per 32 values, like fp16, but with fp32's exponent
range. fp16 scales flush the moments of gradients below ~1e-8 to zero (the second moment of a 1e-10
gradient is 1e-20, far under fp16's 6e-8 smallest subnormal) and overflow for gradients above ~256
(v = 65536+). A bf16 scale keeps both ends. Codes are computed against the EXACT fp32 absmax ``A``, so a
group's largest value always gets the end code (127 / 255); the stored scale is that absmax rounded to
bf16, so dequantized values carry at most 2^-8 relative scale error on top of the code step. This makes
quantization idempotent: quantize(dequantize(codes, scale)) gives back the same codes and scale, which is
what lets the portable (fp32) checkpoint format round-trip exactly.

The fp32 arithmetic, written so that the fused kernel does the same operations with few divisions:
- companded ``m``: ``code = round(254 m / (A + |m|))``, the companding with ``x = m / A`` multiplied out
  (one division per value, no reciprocal of ``A``), computed with ``m`` and ``A`` scaled by the power of
  two ``s`` that brings ``A`` into [1, 2) (``pow2_normalizer``): ``(m * (254 s)) / (A s + |m| s)``.
  Scaling by a power of two is exact, so this is the same quotient wherever nothing under- or overflows;
  it keeps every divisor in [1, 8) (``A`` below 2^-119: at least 2^-30), where the kernel's division needs no
  range check (``bits.div_normalized`` of the Triton kernel), and ``254 m`` cannot overflow;
- linear ``m`` and both ``v`` codes: ``code = round(x * (K / A))`` with K = 127 or 255: ONE division per
  group, a multiplication per value. ``K / A`` overflows fp32 for A below ~2^-121 (subnormal moments), so
  groups whose absmax is below ``TINY = 2^-64`` are first lifted by 2^64 (``(x * 2^64) * (K / (A * 2^64))``);
  lifting is exact, and where neither product over- or underflows it gives the same bits as no lifting;
- dequantizing companded ``m`` reads ``y / (2 - |y|)`` from a 256-entry fp32 table (``exp_avg_table``)
  built with exactly that fp32 arithmetic; dequantizing multiplies each code's value by ONE per-group
  number (scale / 127 or / 255 as a multiplication by INV127 / INV255, squared for companded ``v``, and
  times beta1 / beta2 inside the step);
- ``sqrt`` is the correctly rounded fp32 square root (``sqrt_rn``), what the kernel and CUDA compute.
Every quotient stays within 127 (255) up to a few fp32 ulps, so no clamp is needed before rounding.
Rounding is to nearest, ties to even (``torch.round``): the kernel rounds with one fp32 addition of
1.5 * 2^23 (or 2^23), whose low byte is then the code.
"""

from __future__ import annotations

import struct

import torch

GROUP = 32


def f32(x: float) -> float:
    """The nearest fp32 value, as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


INV127 = f32(1.0 / 127.0)  # fp32 constants: the kernel multiplies by exactly these values
INV255 = f32(1.0 / 255.0)
TINY = 2.0**-64  # groups with an absmax below this are lifted by LIFT before the reciprocal (see above)
LIFT = 2.0**64
# The largest group absmaxes whose scales the next step can dequantize without overflow (``scale_fits``):
SCALE_MAX = 3.396177326406364e38  # fp32 0x7F7F7FFF: the largest value that rounds to a finite bf16
SQRT_SCALE_MAX = 1.841071417717896e19  # fp32 0x5F7F7FFF: rounds to bf16 0x5F7F (1.8375e19), whose square is finite


def quantized_layout(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(rows, cols, groups_per_row)`` for a parameter of this GLOBAL shape, or None when its moments stay
    fp32 (0-d and 1-d parameters: biases and norm weights, a tiny share of any model)."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    return rows, cols, (cols + GROUP - 1) // GROUP


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (IEEE ``sqrt``, what CUDA's ``sqrtf`` and the kernel compute).

    torch's vectorised CPU ``sqrt`` for fp32 is not correctly rounded in some builds (torch 2.13: about 18%
    of results one ulp off). Here: the float64 root rounded to fp32, then whichever of that value and its
    two fp32 neighbours is nearest, decided exactly: ``s`` is the rounded root iff ``x`` lies between the
    squares of the midpoints to its neighbours (midpoints have 25 bits, their squares 50: exact in float64,
    and never equal to an fp32 ``x``, so there are no ties)."""
    x = x.float()
    d = x.double()
    s = d.sqrt().float()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    down = torch.nextafter(s, torch.zeros_like(s))
    sd = s.double()
    hi = (sd + up.double()) * 0.5
    lo = (sd + down.double()) * 0.5
    fixed = torch.where(d > hi * hi, up, torch.where(d < lo * lo, down, s))
    return torch.where((x > 0) & torch.isfinite(x), fixed, s)  # 0, -0, inf, NaN, negatives: as computed


def _exp_avg_table_values() -> torch.Tensor:
    y = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).float() * INV127
    return y / (2.0 - y.abs())


# companded first moment, code -> y / (2 - |y|) for y = code / 127 (fp32), indexed by the code's byte
# (0..127 for codes 0..127, 128..255 for codes -128..-1)
EXP_AVG_TABLE = _exp_avg_table_values()
_TABLES: dict[torch.device, torch.Tensor] = {}


def exp_avg_table(device: torch.device | str) -> torch.Tensor:
    """``EXP_AVG_TABLE`` on ``device`` (one cached copy per device)."""
    device = torch.device(device)
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = EXP_AVG_TABLE.to(device)
    return table


def to_bf16_value(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest bf16 (ties to even) and return it as fp32."""
    return x.to(torch.bfloat16).float()


def grouped(x: torch.Tensor, cols: int) -> torch.Tensor:
    """View a tensor of ``rows * cols`` values as ``(rows, groups, 32)``, zero-padding each row's tail."""
    x = x.reshape(x.numel() // cols if cols else 0, cols)
    pad = (-cols) % GROUP
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[0], x.shape[1] // GROUP, GROUP)


def ungrouped(x: torch.Tensor, cols: int, shape) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2])[:, :cols].reshape(shape)


def group_absmax(groups: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each group of ``grouped(x, cols)``, shape ``(rows, groups, 1)``; a NaN in a
    group makes it NaN."""
    if not groups.numel():
        return groups.new_zeros(groups.shape[:-1] + (1,))
    return groups.abs().amax(dim=-1, keepdim=True)


def scale_fits(absmax: torch.Tensor, is_sqrt: bool) -> torch.Tensor:
    """Per group: True where a moment with this absmax can be stored, False where its bf16 scale would
    overflow (also for a NaN absmax).

    ``absmax <= SCALE_MAX`` (the scale rounds to a finite bf16 value), or ``<= SQRT_SCALE_MAX`` for codes of
    sqrt(v) (``is_sqrt``): there the next step squares the scale, and bf16 values from 2^64 on have an
    infinite square. A scale that fits dequantizes to finite values times any factor up to 1 (the betas), and
    a moment that only decays stays within it, so a group whose moment once fit is never refused for values
    that decay from it."""
    return absmax <= (SQRT_SCALE_MAX if is_sqrt else SCALE_MAX)


def nonzero_or_one(absmax: torch.Tensor) -> torch.Tensor:
    """``absmax`` where it is positive, else 1 (an all-zero group, or a NaN one): the divisor of a group."""
    return torch.where(absmax > 0, absmax, torch.ones_like(absmax))


def pow2_normalizer(a: torch.Tensor) -> torch.Tensor:
    """The power of two ``s = 2^(127 - e)`` for each (non-negative, finite) fp32 ``a`` of biased exponent
    ``e`` clamped to [8, 253], so that ``a * s`` lies in [1, 2): in [2, 4) for ``a >= 2^127``, and for ``a``
    below 2^-119 in [2^-30, 1), since ``254 s`` must stay finite. Always a normal fp32 number."""
    e = (a.float().view(torch.int32) >> 23).clamp(8, 253)
    return ((254 - e) << 23).view(torch.float32)


def scaled_by_reciprocal(x: torch.Tensor, absmax: torch.Tensor, k: float) -> torch.Tensor:
    """``x * (k / absmax)`` per group (``absmax`` > 0, one value per group): one division per group, lifted
    by 2^64 for tiny groups so that the reciprocal cannot overflow."""
    lift = torch.where(absmax < TINY, torch.full_like(absmax, LIFT), torch.ones_like(absmax))
    # a tensor divided by a tensor (``k / t`` with a Python ``k`` is torch's reciprocal times k: two roundings)
    return (x * lift) * (torch.full_like(absmax, k) / (absmax * lift))


def quantize_exp_avg(m: torch.Tensor, cols: int, companded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 first moment -> (int8 codes of m's shape, bf16 scales (rows, groups))."""
    mg = grouped(m.float(), cols)
    absmax = group_absmax(mg)
    scale = to_bf16_value(absmax)
    if companded:
        a = nonzero_or_one(absmax)
        s = pow2_normalizer(a)
        q = (mg * (254.0 * s)) / (a * s + mg.abs() * s)
    else:
        q = scaled_by_reciprocal(mg, nonzero_or_one(absmax), 127.0)
    codes = torch.round(q).to(torch.int8)
    return ungrouped(codes, cols, m.shape), scale.squeeze(-1).to(torch.bfloat16)


def dequantize_exp_avg(codes: torch.Tensor, scales: torch.Tensor, cols: int, companded: bool,
                       factor: float = 1.0) -> torch.Tensor:
    """int8 codes and bf16 scales -> fp32 first moment, times ``factor`` (the step passes beta1).

    One rounding per value: the code's value times a per-group multiplier, ``scale * factor`` (companded:
    the value from ``EXP_AVG_TABLE``) or ``(scale / 127) * factor`` (linear, as ``scale * INV127``)."""
    s = scales.float().unsqueeze(-1)
    if companded:
        y = exp_avg_table(codes.device)[grouped(codes.view(torch.uint8), cols).long()]
        multiplier = s * factor
    else:
        y = grouped(codes.float(), cols)
        multiplier = (s * INV127) * factor
    return ungrouped(y * multiplier, cols, codes.shape)


def quantize_exp_avg_sq(v: torch.Tensor, cols: int, companded: bool, *, is_sqrt: bool = False):
    """fp32 second moment -> (uint8 codes, bf16 scales). With ``is_sqrt`` the input is already sqrt(v)."""
    u = v.float() if (is_sqrt or not companded) else sqrt_rn(v)
    ug = grouped(u, cols)
    absmax = group_absmax(ug)  # u >= 0
    scale = to_bf16_value(absmax)
    codes = torch.round(scaled_by_reciprocal(ug, nonzero_or_one(absmax), 255.0)).to(torch.uint8)
    return ungrouped(codes, cols, v.shape), scale.squeeze(-1).to(torch.bfloat16)


def dequantize_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor, cols: int, companded: bool,
                          factor: float = 1.0) -> torch.Tensor:
    """uint8 codes and bf16 scales -> fp32 second moment, times ``factor`` (the step passes beta2).

    With ``s = scale * INV255`` per group: ``code^2 * ((s * s) * factor)`` (companded: the code is of
    sqrt(v); code^2 is exact) or ``code * (s * factor)`` (linear): one rounding per value."""
    s = scales.float().unsqueeze(-1) * INV255
    c = grouped(codes.float(), cols)
    if companded:
        return ungrouped((c * c) * ((s * s) * factor), cols, codes.shape)
    return ungrouped(c * (s * factor), cols, codes.shape)
