"""Bit-exact arithmetic of the fused step: the jitted helpers and constants every part of the kernel uses.

Each helper computes what the eager reference (``flashdist.kernels.reference``) computes, bit for bit, in a
way that compiles to few instructions on the GPU:
- bf16 moves through its bits (loaded as int16 and widened; fp32 rounded to bf16 by an integer
  round-to-nearest-even on the fp32 bit pattern, since the interpreter's ``.to(tl.bfloat16)`` truncates);
- divisions and square roots are IEEE's (``tl.div_rn`` / ``tl.sqrt_rn``; Triton's ``/`` and ``tl.sqrt`` are
  approximate on the GPU), or CUDA's fast path alone where the operands are known to lie in the range where
  it is IEEE's (``div_normalized``, ``sqrt_rn``);
- a code's rounding is one fp32 addition (``code_bits``), not a conversion;
- every value keeps the layout of its loads, so that none moves between layouts through shared memory
  (``gather``, ``neg``).
``COMPILED`` selects the GPU's inline assembly; under ``TRITON_INTERPRET`` (no libdevice, no inline
assembly) the same results come from numpy's IEEE operations.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .. import reference
from ...quant import codes as Q

# the update of a call (the kernel's constexpr ALGO), as host ints and as constexprs for jitted code
ADAM, SGD, LION = 0, 1, 2
ADAM_ALGO, SGD_ALGO, LION_ALGO = tl.constexpr(ADAM), tl.constexpr(SGD), tl.constexpr(LION)

GROUP = tl.constexpr(Q.GROUP)
INV127 = tl.constexpr(Q.INV127)
INV255 = tl.constexpr(Q.INV255)
TINY = tl.constexpr(Q.TINY)
LIFT = tl.constexpr(Q.LIFT)
FP32_EXP_MASK = tl.constexpr(0x7F800000)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
SCALE_MAX = tl.constexpr(Q.SCALE_MAX)  # codes.scale_fits' limits
SQRT_SCALE_MAX = tl.constexpr(Q.SQRT_SCALE_MAX)
# fp32 magnitude bits from which split_bf16's parameter may round to infinity (int8 rho: half a rho step
# below the midpoint between bf16's largest value and infinity); merge_bf16's states past it are not split's
SPLIT_LIMIT = tl.constexpr(0x7F7F7F80)
UPDATE_FLUSH = tl.constexpr(reference.UPDATE_FLUSH)
# code_bits' addends: 1.5 * 2^23 for signed codes, 2^23 for unsigned ones
SIGNED_CODE_MAGIC = tl.constexpr(12582912.0)
UNSIGNED_CODE_MAGIC = tl.constexpr(8388608.0)
BF16_NAN = tl.constexpr(0x7FC0)  # CUDA torch's bf16 for any NaN (CPU builds differ: torch 2.13 gives 0xFFFF)
SIGN_BIT = tl.constexpr(-(2**31))  # 0x80000000 as an int32


# Few and only where the logic repeats or is tested on its own: under TRITON_INTERPRET every call of a
# jitted helper costs milliseconds (the interpreter re-patches triton.language), which dominates the CPU
# tests.


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> the nearest bf16 (ties to even) as its bit pattern in the low 16 bits of an int32, sign
    extended; NaN -> 0x7FC0 like CUDA torch. ``(bits << 16)`` bitcast to fp32 is the rounded value."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, BF16_NAN, rounded)


@triton.jit
def code_bits(q, MAGIC: tl.constexpr):
    """``torch.round(q)`` (to nearest, ties to even) in the low byte of an int32, for ``|q| <= 2^22``: the
    fp32 sum ``q + MAGIC`` (1.5 * 2^23 for signed codes, 2^23 for unsigned ones) lies in [2^23, 2^24), where
    fp32's spacing is 1, so the addition itself rounds ``q`` to an integer, and its bits are ``bits(MAGIC) +
    round(q)``. One addition, where a conversion to int32 runs on the slow conversion pipe."""
    return (q + MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def divide(x, y, EXACT: tl.constexpr, COMPILED: tl.constexpr):
    """``x / y``: IEEE (``EXACT``), else ``div.approx.f32`` on the GPU (``COMPILED``: 2 ulp for ``|y|`` in
    [2^-126, 2^126]; a reciprocal and a multiplication) or Triton's ``/`` (numpy's IEEE division under the
    interpreter, which cannot call libdevice)."""
    if EXACT:
        return tl.div_rn(x, y)
    elif COMPILED:
        return libdevice.fast_dividef(x, y)
    else:
        return x / y


@triton.jit
def neg(x, COMPILED: tl.constexpr):
    """``-x``, as PTX's ``neg.f32``, which the assembler folds into the instruction that uses it (triton 3.6
    writes ``-x`` as ``0 - x``: an instruction of its own, and ``+0`` for ``x = +0``)."""
    if COMPILED:
        return tl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return -x


@triton.jit
def gather(ptrs, COMPILED: tl.constexpr):
    """``tl.load(ptrs)`` of fp32 values that no program writes (the codes table), through the read-only
    cache path, as an elementwise operation: its result keeps the layout of ``ptrs``, that of the block's
    other values. (Triton lays a ``tl.load`` out by its addresses' contiguity, none for a gather; triton 3.6
    then moved the block's values into that layout and back through shared memory.)"""
    if COMPILED:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


# Widening of bf16 bits (``bf16_value``), two values a register as loaded: the low half shifted up, the high
# half masked in place.
BF16_WIDEN_ASM = tl.constexpr("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;")


@triton.jit
def bf16_value(x, COMPILED: tl.constexpr):
    """The fp32 value of bf16 bits ``x`` (an int16 block as loaded): one instruction per value on the GPU
    (widening the int16 first costs two)."""
    if COMPILED:
        return tl.inline_asm_elementwise(BF16_WIDEN_ASM, "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def magnitude_max(x):
    """The largest magnitude of an fp32 block (1-d, or 2-d by rows) as int32 bits (NaN as a magnitude above
    infinity's): pairs of one thread's values compared as floats, whose absolute values come free with the
    comparison, then a maximum over the ints (a warp's int maximum is one instruction, a float one is five
    shuffles)."""
    if len(x.shape) == 1:
        a, b = tl.split(tl.reshape(x, (x.shape[0] // 2, 2)))
    else:
        a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    m = tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)
    return tl.max(m.to(tl.int32, bitcast=True))


@triton.jit
def max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def group_normalizer(m, COMPILED: tl.constexpr):
    """Per group (row) of a block of first moments: the absmax ``A`` (NaN where a value is NaN), ``a`` (``A``,
    or 1 where it is 0 or NaN), the biased exponent ``e`` of ``a`` clamped to [8, 253], and
    ``s = 2^(127 - e)`` (``codes.pow2_normalizer``).

    Under the interpreter, which calls a reduction's combine function in Python once per pair of values, the
    absmax is the largest of the magnitudes' bits instead: the same value wherever it is finite or infinite,
    and a NaN wherever the row holds one (a NaN's magnitude bits lie above infinity's), which is all that
    reads it (the skip test, and the scale stored only for groups that are kept)."""
    if COMPILED:
        absmax = tl.reduce(tl.abs(m), 1, max_propagating_nan)
    else:
        absmax = tl.max(tl.abs(m).to(tl.int32, bitcast=True), 1).to(tl.float32, bitcast=True)
    a = tl.where(absmax > 0, absmax, 1.0)
    e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 8), 253)
    return absmax, a, e, ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def div_normalized(n, d, COMPILED: tl.constexpr):
    """``n / d``, IEEE's quotient wherever no intermediate leaves fp32's normal range. Its callers keep there:
    - the companding: divisors in [2^-30, 8); quotients below 2^-64 may be off in their last bit, but those
      round to code 0 either way;
    - Adam's update (``FAST_UPDATE``): numerators 0 or of magnitude in [2^-48, 4), divisors in [2^-122, 2^76],
      quotients in [2^-125, 2^124].
    tests/test_gpu.py checks both ranges against CUDA's ``div.rn``.

    The fast path of CUDA's IEEE division without its range check (``FCHK``) and the branch to the slow
    path around it, 4 of the 10 instructions a division costs: an approximate reciprocal, one Newton step
    for it, the quotient, its remainder (exact, by an FMA) and one correction. Under the interpreter the
    reciprocal is numpy's correctly rounded one, which the same steps also correct."""
    if COMPILED:  # MUFU.RCP alone (libdevice's fast_dividef(1, d) adds a flush of its result)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = 1.0 / d
    neg_d = neg(d, COMPILED)
    r = tl.fma(r, tl.fma(neg_d, r, 1.0), r)
    q = n * r
    return tl.fma(tl.fma(neg_d, q, n), r, q)


@triton.jit
def sqrt_rn(v, COMPILED: tl.constexpr):
    """``tl.sqrt_rn(v)``, IEEE's square root, for ``v >= 0``. CUDA's takes a fast path for each value in
    [2^-101, fp32's largest] and calls a slow one for the others (0, subnormals, inf, NaN), a check and a
    branch per value. Here the check is one for the whole block: when every value lies in that range, the
    block computes the fast path alone, the same instructions (an approximate reciprocal root, its product
    with ``v`` and one correction); otherwise ``tl.sqrt_rn``. tests/test_gpu.py checks the fast path against
    CUDA's root on every fp32 value of its range."""
    if COMPILED:
        # (bits - 2^-101's bits) as unsigned: in range up to 0x727FFFFF, the test CUDA's own code makes
        if tl.max((v.to(tl.int32, bitcast=True) - 0x0D000000).to(tl.uint32, bitcast=True)) <= 0x727FFFFF:
            r = tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                          is_pure=True, pack=1)
            root = v * r
            u = tl.fma(tl.fma(neg(root, COMPILED), root, v), r * 0.5, root)
        else:
            u = tl.sqrt_rn(v)
    else:
        u = tl.sqrt_rn(v)
    return u



# TRITON_INTERPRET was set when triton was imported: kernels run in numpy, which has no libdevice and no
# inline assembly (COMPILED is False)
INTERPRETED = not isinstance(f32_to_bf16_bits, triton.runtime.JITFunction)
