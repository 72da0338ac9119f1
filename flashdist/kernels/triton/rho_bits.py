"""rho's split and merge (``flashdist.quant.rho``) inside the kernel: the master weight from a parameter and
its correction, and back, as integer arithmetic on fp32 bit patterns (bf16 parameters) or with units built
from exponent bits (fp16 parameters), bitwise equal to the reference's float arithmetic."""

from __future__ import annotations

import triton
import triton.language as tl

from .bits import BF16_NAN, FP32_EXP_MASK, SIGN_BIT, SPLIT_LIMIT, f32_to_bf16_bits, magnitude_max


@triton.jit
def round_half_up_along(q, x):
    """``rho._code``'s rounding as an int32: ``floor(q * sign(x) + 0.5) * sign(x)`` (half away from zero of
    ``x``), the sign applied by flipping sign bits."""
    sign = x.to(tl.int32, bitcast=True) & SIGN_BIT
    r = tl.floor((q.to(tl.int32, bitcast=True) ^ sign).to(tl.float32, bitcast=True) + 0.5).to(tl.int32)
    return tl.where(sign != 0, -r, r)


# merge_bf16's one-add sum for int8 rho, four values at a time from the registers as loaded (two of bf16 bits
# p01, p23: value k in half k of them; one of rho bytes r: value k in byte k), in ``prmt`` byte permutes:
# - m: byte k 0xFF where parameter k is negative (the sign byte of its bits replicated), else 0;
#   x = r ^ m; n = m & 0x01010101;
# - per value, b = its bits plus 0xFF where negative (bytes: sign replicated, 0, the two of the parameter)
#   and t = ((rho << 8) ^ s) - 0xFE where negative, (rho << 8) where positive (bytes: n's byte, x's byte,
#   x's byte's sign twice; s = 0 or -1 the parameter's sign): b + t = bits + ((rho << 8) ^ s) - s.
# Three instructions a value and three per four values, against seven a value for the widening, the shifts,
# the sign and the conditional negation one by one.
MERGE_INT8_ASM = tl.constexpr(
    "{ .reg .b32 m, x, n, b, t; "
    "prmt.b32 m, $4, $5, 0xFDB9; xor.b32 x, $6, m; and.b32 n, m, 0x01010101; "
    "prmt.b32 b, $4, 0, 0x1049; prmt.b32 t, x, n, 0x8804; add.u32 $0, b, t; "
    "prmt.b32 b, $4, 0, 0x324B; prmt.b32 t, x, n, 0x9915; add.u32 $1, b, t; "
    "prmt.b32 b, $5, 0, 0x1049; prmt.b32 t, x, n, 0xAA26; add.u32 $2, b, t; "
    "prmt.b32 b, $5, 0, 0x324B; prmt.b32 t, x, n, 0xBB37; add.u32 $3, b, t; }")


@triton.jit
def merge_bf16(p16, rho, RHO_LOG2: tl.constexpr, COMPILED: tl.constexpr):
    """``rho.merge`` for a bf16 parameter (its bits ``p16``, int16 as loaded) and its ``rho`` (int8 or int16,
    as loaded).

    ``rho * h / 2^(k-1)`` is ``rho << RHO_SHIFT`` units of the fp32 grid at the parameter (RHO_SHIFT = 8
    for int8, 0 for int16): bf16 spacing is 2^16 fp32 steps, h half of it, and toward zero from a power of
    two both the fp32 step and h halve. fp32 bit patterns read as sign-magnitude integers are that grid
    (subnormals included), so the reference's exact float sum is an integer sum: the magnitude bits move by
    ``rho << RHO_SHIFT`` away from zero for a positive parameter and toward it for a negative one, one add
    (on the GPU with int8 rho, ``MERGE_INT8_ASM``: the same sum in byte permutes).

    That sum is the reference's wherever the parameter is finite and the sum does not cross zero: every
    state that ``split_bf16`` (or ``rho.split``) makes. Any other state (an infinite or NaN parameter, a
    zero with a rho toward the other sign: user input) gives a magnitude of at least ``SPLIT_LIMIT``, and a
    block holding one takes the general path: the sum on value-ordered bits (``-x`` -> ``-bits(x)``), an
    infinite or NaN parameter left as it is, as in the reference."""
    RHO_SHIFT: tl.constexpr = 15 - RHO_LOG2
    if COMPILED and RHO_SHIFT == 8:
        merged = tl.inline_asm_elementwise(MERGE_INT8_ASM, "=r,=r,=r,=r,r,r,r", [p16, rho], dtype=tl.int32,
                                           is_pure=True, pack=4)
    else:
        bits = p16.to(tl.int32) << 16
        s = bits >> 31  # 0 or -1
        merged = bits + (((rho.to(tl.int32) << RHO_SHIFT) ^ s) - s)
    merged = merged.to(tl.float32, bitcast=True)
    if magnitude_max(merged) >= SPLIT_LIMIT:  # uniform over the block: almost never taken
        bits = p16.to(tl.int32) << 16
        r = rho.to(tl.int32)
        s = bits >> 31
        ordered = ((bits & 0x7FFFFFFF) ^ s) - s + (r << RHO_SHIFT)
        s = ordered >> 31
        merged = ((ordered ^ s) - s) | (s & SIGN_BIT)
        # rho 0 keeps the parameter, -0 included; an infinite or NaN parameter stays as it is
        merged = tl.where((r == 0) | ((bits & FP32_EXP_MASK) == FP32_EXP_MASK), bits, merged)
        merged = merged.to(tl.float32, bitcast=True)
    return merged


# split_bf16's add for int8 rho (RHO_SHIFT 8): ``bits + (s << 8) + 0x8080``, with ``s << 8`` one byte permute
# (a zero byte, then the sign byte of ``bits`` replicated three times) instead of a shift and a multiply-add.
SPLIT_INT8_ASM = tl.constexpr(
    "{ .reg .b32 t; prmt.b32 t, $1, 0, 0xBBB4; add.u32 t, t, $1; add.u32 $0, t, 0x8080; }")
# rho of four such words ``w`` (int8 rho, packed: value k in byte k), ``rho_int8``: byte 1 of each w and the
# sign of each replicated (two permutes of pairs), gathered into the rho bytes and their sign masks (two
# more), then ``bytes ^ masks ^ 0x80808080``: six instructions for four values, against two a value for the
# XOR and the shift to byte 0 and three for four to pack the bytes.
RHO_INT8_ASM = tl.constexpr(
    "{ .reg .b32 a, b, c, d; prmt.b32 a, $1, $2, 0xFB51; prmt.b32 b, $3, $4, 0xFB51; "
    "prmt.b32 c, a, b, 0x5410; prmt.b32 d, a, b, 0x7632; xor.b32 c, c, d; xor.b32 $0, c, 0x80808080; }")


@triton.jit
def split_bf16(theta, x, RHO_LOG2: tl.constexpr, FLAG: tl.constexpr, COMPILED: tl.constexpr):
    """``rho.split`` of fp32 ``theta`` into a bf16 parameter and rho: the parameter's bits are the high 16 of
    an int32 word ``w``; int8 rho is an int8 block (``rho_int8`` of ``w`` on the common path: its byte 1 and
    its sign bit), int16 rho the low half of a second int32 word, so that the stores take them without a
    shift.

    On the fp32 bits of ``theta`` as sign and magnitude ``a``: ``a`` rounded half away from zero to the rho
    grid (``a1 = (a + 2^(RHO_SHIFT-1)) >> RHO_SHIFT``, 2^RHO_SHIFT fp32 steps a rho step), split into the
    nearest bf16 value (2 * 2^(k-1) rho steps a bf16 step; ties toward +inf: up in magnitude for a positive
    ``theta``, down for a negative one) and the remainder, in [-2^(k-1), 2^(k-1) - 1] toward +inf. With
    ``s`` = 0 (positive) or -1, one add does both roundings: ``w = bits + BIAS + (s << RHO_SHIFT)`` holds the
    parameter's magnitude in its high 16 bits and ``a1 + 2^(k-1) + s`` mod 2^k in the rho field, which is
    ``rho + 2^(k-1)`` (positive) or ``2^(k-1) - 1 - rho`` (negative): ``rho = field ^ 2^(k-1) ^ s``. The
    sign bit passes through the add (``s`` is also the sign of ``w``). The parameter's sign is that of
    ``theta`` (a zero keeps it, as the reference's round-to-nearest does).

    Magnitudes from ``SPLIT_LIMIT`` on (the parameter would round to infinity; infinite and NaN ``theta``)
    take the general path, per block: from the midpoint between the largest bf16 value and infinity on, the
    reference rounds to infinity (ties to even), for negative values too; infinite and NaN parameters get rho
    0 and NaN becomes 0x7FC0.

    Returns ``(w, y, x)``, ``y`` the int8 rho or the second word: with ``FLAG``, ``x`` (any fp32 block) is NaN
    where the parameter is not finite (SGD's skip flag, ``new_param``). Only the general path makes such a
    parameter, so the flag costs the common path nothing."""
    RHO_SHIFT: tl.constexpr = 15 - RHO_LOG2
    tb = theta.to(tl.int32, bitcast=True)
    if COMPILED and RHO_SHIFT == 8:
        w = tl.inline_asm_elementwise(SPLIT_INT8_ASM, "=r,r", [tb], dtype=tl.int32, is_pure=True, pack=1)
    else:
        w = tb + ((1 << 15) + ((1 << RHO_SHIFT) >> 1)) + ((tb >> 31) << RHO_SHIFT)
    if RHO_SHIFT == 8:
        y = rho_int8(w, COMPILED)
    else:
        y = w ^ (tb >> 31) ^ (1 << 15)
    if magnitude_max(theta) >= SPLIT_LIMIT:  # uniform over the block: almost never taken
        s = tb >> 31
        a = tb & 0x7FFFFFFF
        v = (a ^ s) - s  # value-ordered
        if RHO_SHIFT != 0:
            v = (v + (1 << (RHO_SHIFT - 1)) + s) >> RHO_SHIFT  # half away from zero
        p = (v + (1 << RHO_LOG2)) >> (RHO_LOG2 + 1)  # bf16 steps, value-ordered; same sign as theta (or 0)
        r = v - (p << (RHO_LOG2 + 1))
        mag = tl.where(a >= 0x7F7F8000, 0x7F80, (p ^ s) - s)
        r = tl.where(mag >= 0x7F80, 0, r)
        if FLAG:
            x = tl.where(mag >= 0x7F80, float("nan"), x)
        w = tl.where(a > 0x7F800000, BF16_NAN, mag | (s & 0x8000)) << 16
        if RHO_SHIFT == 8:
            y = r.to(tl.int8)
        else:  # int16: rho itself is the word's low half
            y = r
    return w, y, x


@triton.jit
def rho_int8(w, COMPILED: tl.constexpr):
    """int8 rho of ``split_bf16``'s words ``w``: byte 1 ``^ 0x80 ^ s``, ``s`` the sign of ``w``."""
    if COMPILED:
        return tl.inline_asm_elementwise(RHO_INT8_ASM, "=r,r,r,r,r", [w], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return ((((w >> 8) ^ (w >> 31) ^ 0x80) << 24) >> 24).to(tl.int8)


@triton.jit
def fp16_unit_exponent(tp, toward_zero):
    """Biased fp32 exponent ``e`` of ``rho.rho_unit`` of an fp16 parameter ``tp`` (fp32), whose ``h`` is
    ``2^(e - 127 - 11)``: the exponent of ``tp``, at least fp16's smallest normal (113), one less at a power
    of two where the error or rho points toward zero."""
    bits = tp.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    pow2 = ((bits & 0x7FFFFF) == 0) & (exp > 113)
    return tl.maximum(exp, 113) - (pow2 & toward_zero).to(tl.int32)


@triton.jit
def merge_fp16(tp, rho, RHO_LOG2: tl.constexpr):
    """``rho.merge`` of an fp16 parameter (as fp32) and an int32 rho: the reference's float sum (it rounds
    for int16 rho, and fp16's subnormals are no uniform fp32 grid), with ``h / 2^(k-1)`` built from
    exponent bits: ``2^(e - 138 - k + 1)``, always a normal fp32 number; rho 0 gives the parameter itself."""
    e = fp16_unit_exponent(tp, signs_differ(rho, tp))
    merged = tp + rho.to(tl.float32) * ((e - 11 - RHO_LOG2) << 23).to(tl.float32, bitcast=True)
    return tl.where(rho == 0, tp, merged)  # rho 0 keeps the parameter, -0 included


@triton.jit
def split_fp16(theta, RHO_LOG2: tl.constexpr):
    """``rho.split`` of fp32 ``theta`` into an fp16 parameter (as fp32) and an int32 rho. The reference's
    ``err / h * 2^(k-1)`` is exact (a power-of-two scaling), so it is ``err`` times ``2^(k-1) / h`` built from
    exponent bits. Past the last positive code the parameter moves up by ``2h`` to its neighbour, whose
    unit toward ``theta`` is ``h`` again (rho's units are half the gap on the side of the error), so the
    reference's second code is the first minus ``2 * 2^(k-1)``."""
    RHO_STEPS = 1 << RHO_LOG2
    low = theta.to(tl.float16).to(tl.float32)  # round to nearest even, as torch
    err = theta - low
    e = fp16_unit_exponent(low, signs_differ(err, low))
    q = err * ((127 + 138 + RHO_LOG2 - e) << 23).to(tl.float32, bitcast=True)
    r = round_half_up_along(q, theta)
    up = (r >= RHO_STEPS) & ((low.to(tl.int32, bitcast=True) & FP32_EXP_MASK) != FP32_EXP_MASK)
    above = low + ((e - 10) << 23).to(tl.float32, bitcast=True)
    above = (above.to(tl.int32, bitcast=True) | (theta.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32,
                                                                                                  bitcast=True)
    low = tl.where(up, above, low)  # (a zero parameter keeps theta's sign)
    r = tl.where(up, round_half_up_along(q - 2.0 * RHO_STEPS, theta), r)
    # a non-finite parameter gets rho 0 (its error, and so the reference's code, is not finite)
    r = tl.where((low.to(tl.int32, bitcast=True) & FP32_EXP_MASK) == FP32_EXP_MASK, 0, tl.maximum(r, -RHO_STEPS))
    return low, r


@triton.jit
def signs_differ(a, b):
    """Sign bits of two 32-bit values differ (floats as their bits). Stands for rho's ``toward_zero`` test
    ``(a < 0 & b > 0) | (a > 0 & b < 0)``: the two differ only where a or b is a zero or a NaN, where the
    unit does not matter (a zero or NaN param is no power of two; a zero error or rho contributes zero
    whatever the unit, a NaN error gives a NaN code either way)."""
    return (a.to(tl.int32, bitcast=True) ^ b.to(tl.int32, bitcast=True)) < 0


@triton.jit
def new_param(theta, x, P_KIND: tl.constexpr, RHO_KIND: tl.constexpr, RHO_LOG2: tl.constexpr,
              FLAG: tl.constexpr, COMPILED: tl.constexpr):
    """``rho.split`` of ``theta`` (without rho: ``theta`` rounded to the param dtype) as (the parameter: its
    bf16 bits in the low 16 of an int32, sign extended, or its fp32 value for fp16 and fp32; rho as an int32
    (with a bf16 parameter: an int8 for int8 rho, rho in the low half for int16 rho), 0 without rho; ``x``,
    with ``FLAG`` NaN where the parameter is not finite)."""
    r = 0
    if P_KIND == 0:
        if RHO_KIND != 0:
            w, r, x = split_bf16(theta, x, RHO_LOG2, FLAG, COMPILED)  # r: int8 rho, or int16's in the low half
            p_out = w >> 16
        else:
            p_out = f32_to_bf16_bits(theta)
            if FLAG:
                x = tl.where((p_out & 0x7F80) == 0x7F80, float("nan"), x)
    else:
        if P_KIND == 1:
            if RHO_KIND != 0:
                p_out, r = split_fp16(theta, RHO_LOG2)
            else:
                p_out = theta.to(tl.float16).to(tl.float32)  # round to nearest even, as torch
        else:
            p_out = theta
        if FLAG:
            x = tl.where((p_out.to(tl.int32, bitcast=True) & FP32_EXP_MASK) == FP32_EXP_MASK, float("nan"), x)
    return p_out, r, x

