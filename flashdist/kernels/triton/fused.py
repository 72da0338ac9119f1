"""Fused multi-tensor FlashAdam(W) step in Triton: the CUDA path behind ``flashdist.functional.flash_adam``.

Semantics. ``adam_step_multi`` does, on every tensor of its lists, exactly what ``reference.adam_step_``
does, operation by operation and with the same fp32 scalars: under ``TRITON_INTERPRET=1`` the results are
bitwise equal, and on CUDA too with ``EXACT`` (the default). To keep that promise on every backend the
kernel
- moves bf16 through its bits: loads them as int16 and widens them, and rounds fp32 to bf16 with an integer
  round-to-nearest-even on the fp32 bit pattern (the interpreter's ``.to(tl.bfloat16)`` truncates);
- divides and takes square roots with ``tl.div_rn`` / ``tl.sqrt_rn`` (IEEE, like the reference; Triton's
  ``/`` and ``tl.sqrt`` are approximate on the GPU), except two divisions of 8-bit moments, whose operands
  the reference and the kernel scale by powers of two into a range where CUDA's fast path alone is IEEE's
  (``_div_normalized``): the companding's, and Adam's update (``reference._adam_update``, when the scalars
  allow: ``FAST_UPDATE``);
- is compiled with ``enable_fp_fusion=False``, so no ``a * b + c`` of the reference becomes an FMA;
- computes what the reference computes exactly in cheaper exact ways where it can: rho's split and merge
  of bf16 parameters as integer arithmetic on fp32 bit patterns (``_merge_bf16``, ``_split_bf16``), the
  fp16 rho unit and its reciprocal from exponent bits, a code's rounding as one fp32 addition
  (``_code_bits``).

Exactness (``EXACT``, from the environment variable ``FLASHDIST_EXACT``, read once at import: ``1`` or
unset for IEEE, ``0`` for the GPU's approximate ones in the update's division, the companding division of
the new first moment and the square root: ``div.approx.f32`` through libdevice's ``fast_dividef`` and
``sqrt.approx.f32``, both flushing subnormals). The approximate variant differs from the reference in the
last bits of those three results, which moves a code by at most one step where it sits next to a rounding
boundary and a master weight by a few fp32 ulps of the update; docs/method.md states the bound and
tests/test_gpu.py checks it. Under the interpreter (no libdevice) both variants compute the IEEE results.

Layout of the work. Each program handles ``GROUPS`` groups of 32 slots, as a ``(GROUPS, 32)`` block: the
group absmax of a scale is a ``tl.max`` over axis 1 (it also gives a group's "gradient not finite" flag,
see below), and no reshape is needed. For quantized moments the block walks GROUP space: group ``gid`` is
group ``gid % gpr`` of row ``gid // gpr`` (``gpr = ceil(cols / 32)``); its slot ``j`` is element
``row * cols + (gid % gpr) * 32 + j``, masked past the end of the row; its scale is ``scales[gid]``. When
``cols`` is a multiple of 32 (``ALIGNED``) the element offsets are simply ``gid * 32 + j``, contiguous and
masked per whole group, so the loads vectorise. For fp32 moments the block is 32 * GROUPS consecutive
elements and each element is its own "group" (skip flag, skip count).

Launches. Tensors are sorted into buckets of one compile-time specialisation (param dtype, grad dtype, rho
dtype, quantized, ALIGNED, 16-byte aligned storage; companded, decoupled and EXACT are per call). Per
bucket:
- tensors below ``LARGE_NUMEL`` elements share ONE launch over a work table of ``(tensor, first block,
  blocks)`` items of up to ``TABLE_BLOCKS`` consecutive blocks of one tensor; each program reads its item,
  then the tensor's addresses and sizes from an int64 table (a chain of two dependent loads, paid once per
  item), tells the compiler the addresses are 16-byte aligned (``tl.multiple_of``), without which the
  loads are not vectorised (GPU.md measured 0.12 vs 0.5 of copy bandwidth), and walks its blocks;
- tensors of ``LARGE_NUMEL`` elements or more get a launch each, with addresses and sizes as kernel
  arguments, each program walking ``LARGE_BLOCKS`` consecutive blocks. A storage that is not 16-byte aligned
  (a view into a flat buffer) lands in a bucket without the alignment hint instead of failing.
While a program computes one block it asks the L2 cache for the next one (``PREFETCH``: one
``prefetch.global.L2`` per 128-byte line of the block's param, grad, rho and moment bytes, a hint that
occupies no register and that nothing waits for; whole blocks only, so that every line asked for holds
bytes of the tensor; the lines' addresses are computed once per program and moved by one multiply-add per
block), so that the next block's loads find their data in L2 instead of waiting for DRAM; programs are one
warp each, so that no barrier makes warps wait for each other (module constants; the measurements are in
docs/benchmarks.md).
The int8 codes are read 8 bytes at a time (alignment hint 8, not 16), so that every load and store of a
block has the layout of the 16-byte bf16 ones and no value changes layout through shared memory.

Launch plans (buckets and their device tables) are cached. A step must not pay per-tensor Python calls
beyond the few that safety needs (each costs tens of nanoseconds; a step can hold thousands of tensors),
so a plan is found and checked with three per tensor:
- the parameter's ``data_ptr`` (with the layout: quantized, rho dtype, cols, the launch constants): a
  parameter whose storage is swapped (``p.data = ...``, as ``module.to`` does) gets a new plan;
- the gradient's ``data_ptr``, compared with the plan's: gradients are new tensors at each step when
  ``zero_grad(set_to_none=True)``, usually at the same addresses; where one moved, the gradients are
  checked again (dtype, size, contiguity, device, alignment) and only the gradient addresses of the
  tables are rewritten (a changed dtype or alignment rebuilds the plan);
- the ``id`` of the first moment (its codes): a state that is replaced, as ``load_state_dict`` does, gets a
  new plan, also while the old tensors live on elsewhere (a state dict kept by the caller).
The plan also holds weak references to every state tensor (moments, scales, rho) whose callbacks drop it
as soon as one is freed, so it never writes to freed memory and an ``id`` it compares names a live
tensor. Not detected: replacing one scales or rho tensor alone while the old one stays alive elsewhere,
and swapping the storage of a state tensor in place (``.data =``, ``set_``); the optimizer does neither.
Measured (H200 host, triton 3.6): 0.49 ms of host time per call for 2,000 tensors, 0.14 ms per step for
the 147 tensors of Llama-3.2-1B, launches included.

Cost. The kernel is bound by instruction issue (Nsight Compute on an H200, triton 3.6, the kernel before
``_gather``: issue slots 77% busy, the integer pipe the busiest at 56%, DRAM at 53% of its peak), so its
speed follows the instructions each value costs. Along the path every element takes (sm_90 SASS, triton
3.6 and 3.9 alike) the exact variant executes about 83 instructions per element, 33 of them integer or
compare/select (a half-rate pipe), and the approximate one about 71; the Llama-3.2-1B shapes run at about
0.85 (exact) and 0.89 (approximate) of the copy-bandwidth floor (docs/benchmarks.md). What keeps those counts down:
- every value of a block stays in the layout of its loads (8 consecutive values per thread, one warp), so
  none moves between layouts through shared memory: the codes-table lookup is ``_gather``, an elementwise
  load that keeps its operand's layout (triton 3.6 gave ``tl.load`` of a gather a layout of its own and
  converted the block's gradient, codes and results to and from it, with barriers: 8% more instructions),
  and a negation is ``_neg`` (triton 3.6 writes ``-x`` as ``0 - x``, an instruction of its own, where
  ``neg.f32`` folds into the instruction that uses it); launch/kernel_sass.py counts shared-memory
  instructions (none) and tests check it;
- rho's split and merge of bf16 parameters are one integer add each (``_split_bf16``, ``_merge_bf16``),
  and the stores take their fields without shifts; values near infinity and states the split never makes
  take the general integer code, for a whole block at once (a block-wide max, a uniform branch);
- the exact variant's IEEE operations run CUDA's fast paths without their per-value range checks and
  branches: the two divisions of 8-bit moments because their operands are scaled into a range where the
  fast path is IEEE's (``_div_normalized``), the square root with one range check per block
  (``_sqrt_rn``);
- codes are rounded by one fp32 addition (``_code_bits``), not a conversion.
The approximate variant with 8-bit moments is compiled with at most ``APPROX_MAX_REGISTERS`` registers
(more warps per SM: 83 registers under triton 3.6 against the compiler's 111, no spills; measured 2-3% faster
with the kernel before ``_gather``, and the same with the current one).

Non-finite gradients, and finite ones whose step overflows. A group is not stored (param, rho, codes,
scale keep their values) where ``reference._store_`` skips it, and each program adds its count of such
groups to ``skipped`` with one atomic. With 8-bit moments the flag is one comparison per group of the
absmaxes the scales need anyway (``codes.scale_fits``): the new first moment's, taken with a NaN-propagating
max, is not finite exactly where the gradient is not (with coupled weight decay, also where the parameter
is not), and Adam's second moment adds its own limit to the same predicate; fp32 moments check each value
of the new last moment. SGD's new parameter is checked too (its step has no bound): with bf16 parameters
and rho inside ``_split_bf16``'s general path, the only one that can make an infinite parameter, so the
common path pays nothing; with other parameters one comparison and select per value.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...quant import codes as Q
from ..reference import UPDATE_FLUSH
from ..scalars import AdamScalars, LionScalars, SGDScalars


def _exact_from_env() -> bool:
    value = os.environ.get("FLASHDIST_EXACT", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"flashdist: FLASHDIST_EXACT must be 0 (approximate division and sqrt on the GPU) or 1 "
                         f"(IEEE, the default), got {value!r}")
    return value == "1"


# IEEE division and square root in the kernel (bitwise equal to the reference on CUDA), or the GPU's
# approximate ones. Read once from FLASHDIST_EXACT; set this module attribute to change it in a process.
EXACT = _exact_from_env()

# Launch configuration, from sweeps of the kernel-only step on an H200 (triton 3.6; docs/benchmarks.md). The
# kernel is bound by instruction issue and memory latency, so what lets warps run independently and keep
# loads in flight wins: programs of ONE warp (no barrier couples warps: the scale stores and the final skip
# count convert layouts through shared memory, which with several warps means block-wide barriers), 8 groups
# of 32 slots per block (8 values per thread; 79 registers exact, 72 approximate), 32 blocks per program
# walked with an L2 prefetch of the next block (Llama-3.2-1B shapes, arithmetic of then: 5.8 / 4.9 ms, against
# 7.6 / 6.4 at 32 groups, 4 warps and no prefetch; an L1 prefetch and register caps measured no better).
# Tensors with at least LARGE_NUMEL elements get a launch of their own (only embedding-sized ones: a launch
# costs tens of microseconds of host time).
LARGE_NUMEL = 1 << 26
TABLE_GROUPS = 8  # groups of 32 slots per block in the table launch (256 slots)
TABLE_BLOCKS = 32  # consecutive blocks of one tensor per program of the table launch
LARGE_GROUPS = 8  # groups of 32 slots per block in a per-tensor launch
LARGE_BLOCKS = 32  # consecutive blocks per program of a per-tensor launch
NUM_WARPS = 1
# L2 prefetch of a program's next block while it computes the current one (compiled kernels only)
PREFETCH = True
# blocks ahead of the current one that the L2 prefetch asks for
PREFETCH_AHEAD = 1
# the cache level the prefetch fills: 2 (L2) or 1 (L1 of the program's SM, and L2)
PREFETCH_LEVEL = 2
# registers per thread the compiler may use (None: its choice); fewer let more warps share an SM
MAX_REGISTERS = None
# the cap of the approximate variant with 8-bit moments when MAX_REGISTERS is None (before _gather its Llama-3.2-1B
# step measured 2-3% faster at 88 than at the compiler's 117; the exact variant's about 1% slower, and the fp32
# moments' approximate program spills at 88: docs/benchmarks.md; with _gather the same with and without it)
APPROX_MAX_REGISTERS = 88
# cached launch plans: a few per optimizer call site (one per bucket of step count / layout), and gradient
# release steps each batch of FSDP2 groups with a call of its own (with bucket_mb=0 an 8B Llama makes 33
# batches, two layouts each)
PLAN_CACHE_SIZE = 256

# the update of a call (the kernel's constexpr ALGO)
ADAM, SGD, LION = 0, 1, 2
_ADAM, _SGD, _LION = tl.constexpr(ADAM), tl.constexpr(SGD), tl.constexpr(LION)

_GROUP = tl.constexpr(Q.GROUP)
_INV127 = tl.constexpr(Q.INV127)
_INV255 = tl.constexpr(Q.INV255)
_TINY = tl.constexpr(Q.TINY)
_LIFT = tl.constexpr(Q.LIFT)
_FP32_EXP_MASK = tl.constexpr(0x7F800000)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_SCALE_MAX = tl.constexpr(Q.SCALE_MAX)  # codes.scale_fits' limits
_SQRT_SCALE_MAX = tl.constexpr(Q.SQRT_SCALE_MAX)
# fp32 magnitude bits from which _split_bf16's parameter may round to infinity (int8 rho: half a rho step
# below the midpoint between bf16's largest value and infinity); _merge_bf16's states past it are not split's
_SPLIT_LIMIT = tl.constexpr(0x7F7F7F80)
_UPDATE_FLUSH = tl.constexpr(UPDATE_FLUSH)
# FAST_UPDATE's scalar range (see _step_multi)
_UPDATE_EPS_MIN = 2.0**-122
_UPDATE_SCALAR_MAX = 2.0**12
# _code_bits' addends: 1.5 * 2^23 for signed codes, 2^23 for unsigned ones
_SIGNED_CODE_MAGIC = tl.constexpr(12582912.0)
_UNSIGNED_CODE_MAGIC = tl.constexpr(8388608.0)
_BF16_NAN = tl.constexpr(0x7FC0)  # CUDA torch's bf16 for any NaN (CPU builds differ: torch 2.13 gives 0xFFFF)
_SIGN_BIT = tl.constexpr(-(2**31))  # 0x80000000 as an int32

# dtype codes of the kernel's constexpr arguments
_FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_RHO_KIND = {None: 0, torch.int8: 1, torch.int16: 2}
_RHO_LOG2 = {None: 7, torch.int8: 7, torch.int16: 15}  # log2 of rho.RHO_STEPS (unused without rho)
# Row of the per-tensor int64 table of the table launch: the 7 addresses (p, g, m, v, ms, vs, rho), then
# numel, ngroups, cols, gpr; padded to 16 entries so that one row is one 128-byte line.
_TABLE_FIELDS = 11
_TABLE_STRIDE = tl.constexpr(16)
_GRAD_COLUMN = 1

_data_ptr = torch.Tensor.data_ptr


# ----- elementwise helpers ---------------------------------------------------------------------------------
# Few and only where the logic repeats or is tested on its own: under TRITON_INTERPRET every call of a
# jitted helper costs milliseconds (the interpreter re-patches triton.language), which dominates the CPU
# tests.


@triton.jit
def _f32_to_bf16_bits(x):
    """fp32 -> the nearest bf16 (ties to even) as its bit pattern in the low 16 bits of an int32, sign
    extended; NaN -> 0x7FC0 like CUDA torch. ``(bits << 16)`` bitcast to fp32 is the rounded value."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, _BF16_NAN, rounded)


@triton.jit
def _code_bits(q, MAGIC: tl.constexpr):
    """``torch.round(q)`` (to nearest, ties to even) in the low byte of an int32, for ``|q| <= 2^22``: the
    fp32 sum ``q + MAGIC`` (1.5 * 2^23 for signed codes, 2^23 for unsigned ones) lies in [2^23, 2^24), where
    fp32's spacing is 1, so the addition itself rounds ``q`` to an integer, and its bits are ``bits(MAGIC) +
    round(q)``. One addition, where a conversion to int32 runs on the slow conversion pipe."""
    return (q + MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def _divide(x, y, EXACT: tl.constexpr, COMPILED: tl.constexpr):
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
def _neg(x, COMPILED: tl.constexpr):
    """``-x``, as PTX's ``neg.f32``, which the assembler folds into the instruction that uses it (triton 3.6
    writes ``-x`` as ``0 - x``: an instruction of its own, and ``+0`` for ``x = +0``)."""
    if COMPILED:
        return tl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return -x


@triton.jit
def _gather(ptrs, COMPILED: tl.constexpr):
    """``tl.load(ptrs)`` of fp32 values that no program writes (the codes table), through the read-only
    cache path, as an elementwise operation: its result keeps the layout of ``ptrs``, that of the block's
    other values. (Triton lays a ``tl.load`` out by its addresses' contiguity, none for a gather; triton 3.6
    then moved the block's values into that layout and back through shared memory.)"""
    if COMPILED:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_normalizer(m):
    """Per group (row) of a block of first moments: the absmax ``A`` (NaN where a value is NaN), ``a`` (``A``,
    or 1 where it is 0 or NaN), the biased exponent ``e`` of ``a`` clamped to [8, 253], and
    ``s = 2^(127 - e)`` (``codes.pow2_normalizer``)."""
    absmax = tl.reduce(tl.abs(m), 1, _max_propagating_nan)
    a = tl.where(absmax > 0, absmax, 1.0)
    e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 8), 253)
    return absmax, a, e, ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _div_normalized(n, d, COMPILED: tl.constexpr):
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
    neg_d = _neg(d, COMPILED)
    r = tl.fma(r, tl.fma(neg_d, r, 1.0), r)
    q = n * r
    return tl.fma(tl.fma(neg_d, q, n), r, q)


@triton.jit
def _sqrt_rn(v, COMPILED: tl.constexpr):
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
            u = tl.fma(tl.fma(_neg(root, COMPILED), root, v), r * 0.5, root)
        else:
            u = tl.sqrt_rn(v)
    else:
        u = tl.sqrt_rn(v)
    return u


@triton.jit
def _round_half_up_along(q, x):
    """``rho._code``'s rounding as an int32: ``floor(q * sign(x) + 0.5) * sign(x)`` (half away from zero of
    ``x``), the sign applied by flipping sign bits."""
    sign = x.to(tl.int32, bitcast=True) & _SIGN_BIT
    r = tl.floor((q.to(tl.int32, bitcast=True) ^ sign).to(tl.float32, bitcast=True) + 0.5).to(tl.int32)
    return tl.where(sign != 0, -r, r)


@triton.jit
def _merge_bf16(p16, rho, RHO_SHIFT: tl.constexpr):
    """``rho.merge`` for a bf16 parameter (its bits ``p16``, int32 sign extended) and an int32 ``rho``.

    ``rho * h / 2^(k-1)`` is ``rho << RHO_SHIFT`` units of the fp32 grid at the parameter (RHO_SHIFT = 8
    for int8, 0 for int16): bf16 spacing is 2^16 fp32 steps, h half of it, and toward zero from a power of
    two both the fp32 step and h halve. fp32 bit patterns read as sign-magnitude integers are that grid
    (subnormals included), so the reference's exact float sum is an integer sum: the magnitude bits move by
    ``rho << RHO_SHIFT`` away from zero for a positive parameter and toward it for a negative one, one add.

    That sum is the reference's wherever the parameter is finite and the sum does not cross zero: every
    state that ``_split_bf16`` (or ``rho.split``) makes. Any other state (an infinite or NaN parameter, a
    zero with a rho toward the other sign: user input) gives a magnitude of at least ``_SPLIT_LIMIT``, and a
    block holding one takes the general path: the sum on value-ordered bits (``-x`` -> ``-bits(x)``), an
    infinite or NaN parameter left as it is, as in the reference."""
    bits = p16 << 16
    s = bits >> 31  # 0 or -1
    merged = bits + (((rho << RHO_SHIFT) ^ s) - s)
    if tl.max(merged & 0x7FFFFFFF) >= _SPLIT_LIMIT:  # uniform over the block: almost never taken
        ordered = ((bits & 0x7FFFFFFF) ^ s) - s + (rho << RHO_SHIFT)
        s = ordered >> 31
        merged = ((ordered ^ s) - s) | (s & _SIGN_BIT)
        # rho 0 keeps the parameter, -0 included; an infinite or NaN parameter stays as it is
        merged = tl.where((rho == 0) | ((bits & _FP32_EXP_MASK) == _FP32_EXP_MASK), bits, merged)
    return merged.to(tl.float32, bitcast=True)


@triton.jit
def _split_bf16(theta, x, RHO_LOG2: tl.constexpr, FLAG: tl.constexpr):
    """``rho.split`` of fp32 ``theta`` into a bf16 parameter and rho, as two int32 words: the parameter's
    bits are the high 16 of the first, rho is bits ``RHO_SHIFT`` up of the second (int8: byte 1; int16: the
    low half), so that the stores take them without a shift.

    On the fp32 bits of ``theta`` as sign and magnitude ``a``: ``a`` rounded half away from zero to the rho
    grid (``a1 = (a + 2^(RHO_SHIFT-1)) >> RHO_SHIFT``, 2^RHO_SHIFT fp32 steps a rho step), split into the
    nearest bf16 value (2 * 2^(k-1) rho steps a bf16 step; ties toward +inf: up in magnitude for a positive
    ``theta``, down for a negative one) and the remainder, in [-2^(k-1), 2^(k-1) - 1] toward +inf. With
    ``s`` = 0 (positive) or -1, one add does both roundings: ``w = bits + BIAS + (s << RHO_SHIFT)`` holds the
    parameter's magnitude in its high 16 bits and ``a1 + 2^(k-1) + s`` mod 2^k in the rho field, which is
    ``rho + 2^(k-1)`` (positive) or ``2^(k-1) - 1 - rho`` (negative): ``rho = field ^ 2^(k-1) ^ s``. The
    sign bit passes through the add. The parameter's sign is that of ``theta`` (a zero keeps it, as the
    reference's round-to-nearest does).

    Magnitudes from ``_SPLIT_LIMIT`` on (the parameter would round to infinity; infinite and NaN ``theta``)
    take the general path, per block: from the midpoint between the largest bf16 value and infinity on, the
    reference rounds to infinity (ties to even), for negative values too; infinite and NaN parameters get rho
    0 and NaN becomes 0x7FC0.

    Returns ``(w, y, x)``: with ``FLAG``, ``x`` (any fp32 block) is NaN where the parameter is not finite
    (SGD's skip flag, ``_new_param``). Only the general path makes such a parameter, so the flag costs the
    common path nothing."""
    RHO_SHIFT: tl.constexpr = 15 - RHO_LOG2
    tb = theta.to(tl.int32, bitcast=True)
    s = tb >> 31
    w = tb + ((1 << 15) + ((1 << RHO_SHIFT) >> 1)) + (s << RHO_SHIFT)
    y = w ^ s ^ (1 << 15)
    if tl.max(tb & 0x7FFFFFFF) >= _SPLIT_LIMIT:  # uniform over the block: almost never taken
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
        w = tl.where(a > 0x7F800000, _BF16_NAN, mag | (s & 0x8000)) << 16
        y = r << RHO_SHIFT
    return w, y, x


@triton.jit
def _fp16_unit_exponent(tp, toward_zero):
    """Biased fp32 exponent ``e`` of ``rho.rho_unit`` of an fp16 parameter ``tp`` (fp32), whose ``h`` is
    ``2^(e - 127 - 11)``: the exponent of ``tp``, at least fp16's smallest normal (113), one less at a power
    of two where the error or rho points toward zero."""
    bits = tp.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    pow2 = ((bits & 0x7FFFFF) == 0) & (exp > 113)
    return tl.maximum(exp, 113) - (pow2 & toward_zero).to(tl.int32)


@triton.jit
def _merge_fp16(tp, rho, RHO_LOG2: tl.constexpr):
    """``rho.merge`` of an fp16 parameter (as fp32) and an int32 rho: the reference's float sum (it rounds
    for int16 rho, and fp16's subnormals are no uniform fp32 grid), with ``h / 2^(k-1)`` built from
    exponent bits: ``2^(e - 138 - k + 1)``, always a normal fp32 number; rho 0 gives the parameter itself."""
    e = _fp16_unit_exponent(tp, _signs_differ(rho, tp))
    merged = tp + rho.to(tl.float32) * ((e - 11 - RHO_LOG2) << 23).to(tl.float32, bitcast=True)
    return tl.where(rho == 0, tp, merged)  # rho 0 keeps the parameter, -0 included


@triton.jit
def _split_fp16(theta, RHO_LOG2: tl.constexpr):
    """``rho.split`` of fp32 ``theta`` into an fp16 parameter (as fp32) and an int32 rho. The reference's
    ``err / h * 2^(k-1)`` is exact (a power-of-two scaling), so it is ``err`` times ``2^(k-1) / h`` built from
    exponent bits. Past the last positive code the parameter moves up by ``2h`` to its neighbour, whose
    unit toward ``theta`` is ``h`` again (rho's units are half the gap on the side of the error), so the
    reference's second code is the first minus ``2 * 2^(k-1)``."""
    RHO_STEPS = 1 << RHO_LOG2
    low = theta.to(tl.float16).to(tl.float32)  # round to nearest even, as torch
    err = theta - low
    e = _fp16_unit_exponent(low, _signs_differ(err, low))
    q = err * ((127 + 138 + RHO_LOG2 - e) << 23).to(tl.float32, bitcast=True)
    r = _round_half_up_along(q, theta)
    up = (r >= RHO_STEPS) & ((low.to(tl.int32, bitcast=True) & _FP32_EXP_MASK) != _FP32_EXP_MASK)
    above = low + ((e - 10) << 23).to(tl.float32, bitcast=True)
    above = (above.to(tl.int32, bitcast=True) | (theta.to(tl.int32, bitcast=True) & _SIGN_BIT)).to(tl.float32,
                                                                                                  bitcast=True)
    low = tl.where(up, above, low)  # (a zero parameter keeps theta's sign)
    r = tl.where(up, _round_half_up_along(q - 2.0 * RHO_STEPS, theta), r)
    # a non-finite parameter gets rho 0 (its error, and so the reference's code, is not finite)
    r = tl.where((low.to(tl.int32, bitcast=True) & _FP32_EXP_MASK) == _FP32_EXP_MASK, 0, tl.maximum(r, -RHO_STEPS))
    return low, r


@triton.jit
def _signs_differ(a, b):
    """Sign bits of two 32-bit values differ (floats as their bits). Stands for rho's ``toward_zero`` test
    ``(a < 0 & b > 0) | (a > 0 & b < 0)``: the two differ only where a or b is a zero or a NaN, where the
    unit does not matter (a zero or NaN param is no power of two; a zero error or rho contributes zero
    whatever the unit, a NaN error gives a NaN code either way)."""
    return (a.to(tl.int32, bitcast=True) ^ b.to(tl.int32, bitcast=True)) < 0


@triton.jit
def _new_param(theta, x, P_KIND: tl.constexpr, RHO_KIND: tl.constexpr, RHO_LOG2: tl.constexpr,
               FLAG: tl.constexpr):
    """``rho.split`` of ``theta`` (without rho: ``theta`` rounded to the param dtype) as (the parameter: its
    bf16 bits in the low 16 of an int32, sign extended, or its fp32 value for fp16 and fp32; rho as an int32,
    0 without rho; ``x``, with ``FLAG`` NaN where the parameter is not finite)."""
    r = 0
    if P_KIND == 0:
        if RHO_KIND != 0:
            w, y, x = _split_bf16(theta, x, RHO_LOG2, FLAG)
            p_out = w >> 16
            r = y >> (15 - RHO_LOG2)
        else:
            p_out = _f32_to_bf16_bits(theta)
            if FLAG:
                x = tl.where((p_out & 0x7F80) == 0x7F80, float("nan"), x)
    else:
        if P_KIND == 1:
            if RHO_KIND != 0:
                p_out, r = _split_fp16(theta, RHO_LOG2)
            else:
                p_out = theta.to(tl.float16).to(tl.float32)  # round to nearest even, as torch
        else:
            p_out = theta
        if FLAG:
            x = tl.where((p_out.to(tl.int32, bitcast=True) & _FP32_EXP_MASK) == _FP32_EXP_MASK, float("nan"), x)
    return p_out, r, x


# ----- one block of one tensor -----------------------------------------------------------------------------


@triton.jit
def _step_block(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int64 addresses of one tensor's data
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device (read with COMPANDED quantized moments only)
    blk,  # block index inside the tensor
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    RHO_KIND: tl.constexpr,  # 0 no rho, 1 int8, 2 int16
    QUANTIZED: tl.constexpr,  # 8-bit moments with bf16 group scales (else fp32 moments)
    ALIGNED: tl.constexpr,  # cols is a multiple of 32
    ALIGN16: tl.constexpr,  # every address is a multiple of 16 bytes
    COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    ALGO: tl.constexpr,  # ADAM, SGD or LION: the update, and the moments it keeps (see the module doc)
    HAS_M: tl.constexpr,  # a first moment / momentum buffer exists (SGD without momentum keeps none)
    NESTEROV: tl.constexpr,  # SGD only: Nesterov momentum
    EXACT: tl.constexpr,  # IEEE division and sqrt (else the GPU's approximate ones; see the module doc)
    COMPILED: tl.constexpr,  # compiled for the GPU (libdevice's approximations exist), not interpreted
    FAST_UPDATE: tl.constexpr,  # eps and 1/sqrt(1 - beta2^t) let _div_normalized divide Adam's update (8-bit)
    RHO_LOG2: tl.constexpr,  # log2 of rho.RHO_STEPS: 7 (int8), 15 (int16)
    GROUPS: tl.constexpr,  # groups of 32 slots in this block
):
    RHO_SHIFT = 15 - RHO_LOG2  # fp32 grid steps per rho step at a bf16 param, as a shift
    # Typed pointers. bf16 data (params, grads, scales) moves as int16 bits.
    if P_KIND == 0:
        p_ptr = p_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
    elif P_KIND == 1:
        p_ptr = p_addr.to(tl.int64).to(tl.pointer_type(tl.float16))
    else:
        p_ptr = p_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
    if G_KIND == 0:
        g_ptr = g_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
    elif G_KIND == 1:
        g_ptr = g_addr.to(tl.int64).to(tl.pointer_type(tl.float16))
    else:
        g_ptr = g_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
    if QUANTIZED:
        if COMPANDED:  # the codes' bytes index codes.EXP_AVG_TABLE
            m_ptr = m_addr.to(tl.int64).to(tl.pointer_type(tl.uint8))
        else:
            m_ptr = m_addr.to(tl.int64).to(tl.pointer_type(tl.int8))
        ms_ptr = ms_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
        if ALIGN16:  # 8 (not 16): 8-byte loads of the codes give the layout of the 16-byte bf16 loads
            m_ptr = tl.multiple_of(m_ptr, 8)
            ms_ptr = tl.multiple_of(ms_ptr, 16)
        if ALGO == _ADAM:  # Adam's second moment
            v_ptr = v_addr.to(tl.int64).to(tl.pointer_type(tl.uint8))
            vs_ptr = vs_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
            if ALIGN16:
                v_ptr = tl.multiple_of(v_ptr, 8)
                vs_ptr = tl.multiple_of(vs_ptr, 16)
    elif HAS_M:
        m_ptr = m_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
        if ALIGN16:
            m_ptr = tl.multiple_of(m_ptr, 16)
        if ALGO == _ADAM:  # Adam's second moment
            v_ptr = v_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
            if ALIGN16:
                v_ptr = tl.multiple_of(v_ptr, 16)
    if RHO_KIND == 1:
        rho_ptr = rho_addr.to(tl.int64).to(tl.pointer_type(tl.int8))
    elif RHO_KIND == 2:
        rho_ptr = rho_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
    if ALIGN16:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        if RHO_KIND == 1:
            rho_ptr = tl.multiple_of(rho_ptr, 8)
        elif RHO_KIND == 2:
            rho_ptr = tl.multiple_of(rho_ptr, 16)

    # The block: GROUPS groups of 32 slots, with their element offsets and masks.
    gid = blk * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, _GROUP)
    if QUANTIZED:
        gvalid = gid < ngroups
        if ALIGNED:
            offs = gid[:, None] * _GROUP + lane[None, :]
            mask = gvalid[:, None] & (lane[None, :] < _GROUP)  # constant over a group: vector loads
        else:
            row = gid // gpr
            col = (gid - row * gpr)[:, None] * _GROUP + lane[None, :]
            offs = row[:, None] * cols + col
            mask = gvalid[:, None] & (col < cols)
    else:
        offs = gid[:, None] * _GROUP + lane[None, :]
        mask = offs < numel

    # Gradient (which elements or groups are skipped is decided below, from the new moments).
    if G_KIND == 0:
        g = (tl.load(g_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0).to(tl.float32)

    # Moments: Adam's and SGD's decayed beta1 * m (SGD: momentum * buffer) and Adam's beta2 * v
    # (codes.dequantize_exp_avg / dequantize_exp_avg_sq with the betas as factors), Lion's m itself: each
    # code's value times one per-group multiplier. Masked slots read code 0.
    if QUANTIZED:
        m_scale = (tl.load(ms_ptr + gid, mask=gvalid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        m_code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
        if COMPANDED:
            m_mult = m_scale
        else:
            m_mult = m_scale * _INV127
        if ALGO != _LION:
            m_mult = m_mult * beta1
        if COMPANDED:
            m = _gather(table_ptr + m_code, COMPILED) * m_mult[:, None]  # y / (2 - |y|) of y = code / 127
        else:
            m = m_code.to(tl.float32) * m_mult[:, None]
    elif HAS_M:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        if ALGO != _LION:
            m = m * beta1
    if QUANTIZED and ALGO == _ADAM:
        v_scale = (tl.load(vs_ptr + gid, mask=gvalid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        v_scale = v_scale * _INV255
        v_code = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
        if COMPANDED:
            v = (v_code * v_code).to(tl.float32) * ((v_scale * v_scale) * beta2)[:, None]
        else:
            v = v_code.to(tl.float32) * (v_scale * beta2)[:, None]
    elif ALGO == _ADAM:
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2

    # Master weight (rho.merge).
    if P_KIND == 0:
        p16 = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        if RHO_KIND != 0:
            theta = _merge_bf16(p16, tl.load(rho_ptr + offs, mask=mask, other=0).to(tl.int32), RHO_SHIFT)
        else:
            theta = (p16 << 16).to(tl.float32, bitcast=True)
    else:
        theta = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.float32)
        if RHO_KIND != 0:
            theta = _merge_fp16(theta, tl.load(rho_ptr + offs, mask=mask, other=0).to(tl.int32), RHO_LOG2)

    # The update, in the reference's order (reference.adam_step_, sgd_step_, lion_step_).
    if DECOUPLED:
        theta = theta * decay
    else:
        g = g + theta * weight_decay
    if ALGO == _ADAM:
        m = m + g * one_minus_beta1
        v = v + (g * g) * one_minus_beta2
        if EXACT:
            u = _sqrt_rn(v, COMPILED)
        else:
            u = tl.sqrt(v)
        denom = u * inv_bc2_sqrt + eps
        if QUANTIZED:
            # reference._adam_update: m scaled by codes.pow2_normalizer of the group's absmax, values below
            # 2^-48 taken as 0, divided, times step_size / s; the quotients lie in [2^-125, 2^124] (or are 0)
            # when FAST_UPDATE, where _div_normalized needs no range check or branch. (The approximate variant
            # scales too, to stay the reference's function up to its division; that costs it about 5%.)
            absmax, a, e, s = _group_normalizer(m)
            scaled = m * s[:, None]
            scaled = tl.where(tl.abs(scaled) < _UPDATE_FLUSH, 0.0, scaled)
            if EXACT and FAST_UPDATE:
                quotient = _div_normalized(scaled, denom, COMPILED)
            else:
                quotient = _divide(scaled, denom, EXACT, COMPILED)
            theta = theta - quotient * (step_size * (e << 23).to(tl.float32, bitcast=True))[:, None]  # 1/s
        else:
            theta = theta - _divide(m, denom, EXACT, COMPILED) * step_size
    elif ALGO == _SGD:
        if HAS_M:
            m = m + g * one_minus_beta1
            if NESTEROV:
                d = g + m * beta2
            else:
                d = m
        else:
            d = g
        theta = theta - d * step_size
    else:  # Lion: the sign of an interpolation moves theta; the momentum is a second interpolation
        c = m * beta1 + g * one_minus_beta1
        theta = theta - tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0)) * step_size
        m = m * beta2 + g * one_minus_beta2

    # Skipped groups (reference._store_): with 8-bit moments, those where a new moment does not fit its
    # scale (codes.scale_fits of the group absmax; the first moment's propagates a NaN, and is not finite
    # where the gradient is not); with fp32 moments, the elements whose new last moment is not finite
    # (without moments: whose gradient is not). SGD's step has no bound: its groups are skipped too where
    # the new parameter is not finite, flagged by a NaN in the momentum (or the gradient) there.
    if ALGO == _SGD:
        if HAS_M:
            p_out, r, m = _new_param(theta, m, P_KIND, RHO_KIND, RHO_LOG2, True)
        else:
            p_out, r, g = _new_param(theta, g, P_KIND, RHO_KIND, RHO_LOG2, True)
    if not QUANTIZED:
        if not HAS_M:
            bad = (g.to(tl.int32, bitcast=True) & _FP32_EXP_MASK) == _FP32_EXP_MASK
        elif ALGO == _ADAM:
            bad = ~(v <= _FP32_MAX)
        else:
            bad = ~(tl.abs(m) <= _FP32_MAX)
        keep = mask & ~bad
        n_bad = tl.sum(bad.to(tl.int32), axis=1)
    # New moments (codes.quantize_exp_avg / quantize_exp_avg_sq): codes against the exact group absmax
    # A, stored rounded to bf16 as the scale. Masked slots hold exact zeros (zero code, gradient and
    # param), like the reference's padding, so they need no masking in the max.
    if QUANTIZED:
        # (Adam's update computed the first moment's absmax, with a and the normalizer s below.)
        if ALGO != _ADAM:
            absmax, a, e, s = _group_normalizer(m)
            bad_group = ~(absmax <= _SCALE_MAX)
        elif COMPANDED:  # the second moment is stored as codes of u = sqrt(v)
            v_absmax = tl.max(u, axis=1)
            bad_group = ~(absmax <= _SCALE_MAX) | ~(v_absmax <= _SQRT_SCALE_MAX)
        else:
            v_absmax = tl.max(v, axis=1)
            bad_group = ~(absmax <= _SCALE_MAX) | ~(v_absmax <= _SCALE_MAX)
        keep = mask & ~bad_group[:, None]
        keep_group = gvalid & ~bad_group
        n_bad = bad_group.to(tl.int32)
        if COMPANDED:  # round(254 m / (A + |m|))
            # m and A scaled by s = codes.pow2_normalizer(A): every divisor lies in [2^-30, 8)
            n = m * (254.0 * s)[:, None]
            d = tl.fma(tl.abs(m), s[:, None], (a * s)[:, None])  # fl(|m| s + A s): |m| s is exact or negligible
            if EXACT:
                q = _div_normalized(n, d, COMPILED)
            else:
                q = _divide(n, d, EXACT, COMPILED)
        else:  # round(m * (127 / A)), lifted for tiny groups
            lift = tl.where(a < _TINY, _LIFT, 1.0)
            q = (m * lift[:, None]) * tl.div_rn(tl.full(a.shape, 127.0, tl.float32), a * lift)[:, None]
        tl.store(m_ptr + offs, _code_bits(q, _SIGNED_CODE_MAGIC).to(tl.int8), mask=keep)
        tl.store(ms_ptr + gid, _f32_to_bf16_bits(absmax).to(tl.int16), mask=keep_group)
    if QUANTIZED and ALGO == _ADAM:
        if COMPANDED:
            # x = sqrt(v) is 0 or at least 2^-74.5 (the root of the smallest subnormal), so 255 / A cannot
            # overflow and the reference's lift by 2^64 (A < 2^-64) changes no bit: it is left out here
            absmax = v_absmax
            a = tl.where(absmax > 0, absmax, 1.0)
            q = u * tl.div_rn(tl.full(a.shape, 255.0, tl.float32), a)[:, None]
        else:
            absmax = v_absmax
            a = tl.where(absmax > 0, absmax, 1.0)
            lift = tl.where(a < _TINY, _LIFT, 1.0)
            q = (v * lift[:, None]) * tl.div_rn(tl.full(a.shape, 255.0, tl.float32), a * lift)[:, None]
        tl.store(v_ptr + offs, _code_bits(q, _UNSIGNED_CODE_MAGIC).to(tl.uint8), mask=keep)
        tl.store(vs_ptr + gid, _f32_to_bf16_bits(absmax).to(tl.int16), mask=keep_group)
    elif ALGO == _ADAM:
        tl.store(v_ptr + offs, v, mask=keep)
    if HAS_M and not QUANTIZED:
        tl.store(m_ptr + offs, m, mask=keep)

    # New parameter and rho.
    if ALGO != _SGD:
        p_out, r, theta = _new_param(theta, theta, P_KIND, RHO_KIND, RHO_LOG2, False)
    if P_KIND == 0:
        tl.store(p_ptr + offs, p_out.to(tl.int16), mask=keep)
    elif P_KIND == 1:
        tl.store(p_ptr + offs, p_out.to(tl.float16), mask=keep)
    else:
        tl.store(p_ptr + offs, p_out, mask=keep)
    if RHO_KIND == 1:
        tl.store(rho_ptr + offs, r.to(tl.int8), mask=keep)
    elif RHO_KIND == 2:
        tl.store(rho_ptr + offs, r.to(tl.int16), mask=keep)
    return n_bad  # per group slot of the block: skipped groups (fp32 moments: skipped values)


# ----- consecutive blocks of one tensor --------------------------------------------------------------------


@triton.jit
def _prefetch_lines(p_addr, g_addr, m_addr, v_addr, rho_addr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                    RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr,
                    GROUPS: tl.constexpr, PREFETCH: tl.constexpr):
    """The prefetch's lines, computed once per program: one 128-byte line per slot of a ``PREFETCH``-slot
    vector, the lines of the per-value streams (param, grad, rho, moments) of block 0 one stream after the
    other, and each slot's stream's bytes per block. Block ``blk``'s line of a slot is ``line0 + blk *
    step``: a block of a stream is a whole number of lines (a power of two of at least 128 bytes; a stream
    whose block is smaller gets no slot), so rounding its address down to a line commutes with moving it by
    blocks. A stream that does not start on a line boundary leaves its last partial line of a block to the
    loads. Returns (line0, step): int64 line addresses and int32 bytes per block, both 0 in a slot that
    holds no line."""
    SLOTS: tl.constexpr = GROUPS * 32
    P_LINES: tl.constexpr = SLOTS * (4 if P_KIND == 2 else 2) // 128
    G_LINES: tl.constexpr = SLOTS * (4 if G_KIND == 2 else 2) // 128
    R_LINES: tl.constexpr = SLOTS * RHO_KIND // 128
    M_LINES: tl.constexpr = (SLOTS * (1 if QUANTIZED else 4) // 128) if HAS_M else 0
    V_LINES: tl.constexpr = M_LINES if ALGO == _ADAM else 0
    k = tl.arange(0, PREFETCH)
    zero = tl.zeros((PREFETCH,), tl.int64)
    # each slot's stream: its address, its lines per block, and the slots of the streams before it
    addr = tl.where(k < P_LINES, zero + p_addr, zero + g_addr)
    lines = tl.where(k < P_LINES, P_LINES, G_LINES)
    before = tl.where(k < P_LINES, 0, P_LINES)
    addr = tl.where(k < P_LINES + G_LINES, addr, zero + rho_addr)
    lines = tl.where(k < P_LINES + G_LINES, lines, R_LINES)
    before = tl.where(k < P_LINES + G_LINES, before, P_LINES + G_LINES)
    addr = tl.where(k < P_LINES + G_LINES + R_LINES, addr, zero + m_addr)
    lines = tl.where(k < P_LINES + G_LINES + R_LINES, lines, M_LINES)
    before = tl.where(k < P_LINES + G_LINES + R_LINES, before, P_LINES + G_LINES + R_LINES)
    addr = tl.where(k < P_LINES + G_LINES + R_LINES + M_LINES, addr, zero + v_addr)
    lines = tl.where(k < P_LINES + G_LINES + R_LINES + M_LINES, lines, V_LINES)
    before = tl.where(k < P_LINES + G_LINES + R_LINES + M_LINES, before, P_LINES + G_LINES + R_LINES + M_LINES)
    live = k < P_LINES + G_LINES + R_LINES + M_LINES + V_LINES
    line0 = tl.where(live, ((addr >> 7) << 7) + (k - before).to(tl.int64) * 128, 0)
    return line0, tl.where(live, lines * 128, 0)


@triton.jit
def _prefetch_block(line0, step, blk, LEVEL: tl.constexpr):
    """Ask the cache (L2, or L1 with ``LEVEL`` 1) for block ``blk``'s lines (``_prefetch_lines``), so that a
    program computes one block while the next one's bytes travel. A hint: nothing waits for it and no
    register receives data."""
    line = line0 + blk.to(tl.int64) * step
    live = (line != 0).to(tl.int32)
    if LEVEL == 1:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [line, live], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [line, live], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _step_blocks(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr,
    first, count,  # blocks first .. first + count - 1 of the tensor
    numel, ngroups, cols, gpr,
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr,  # 0, or slots (a power of two >= the lines of a block) of the next block's L2 prefetch
    AHEAD: tl.constexpr,  # the prefetch asks for block j + AHEAD while block j is computed
    LEVEL: tl.constexpr,  # the cache level the prefetch fills (PREFETCH_LEVEL)
):
    """``count`` consecutive blocks of one tensor; the skipped groups are counted per group slot over all of
    them and added to ``skipped`` with one atomic at the end (a per-block count would be a reduction across
    the program's warps, through shared memory and barriers, in every block)."""
    bad = tl.zeros((GROUPS,), tl.int32)
    # Only whole blocks are prefetched: every line asked for then holds bytes of the tensor (the prefetch of
    # an address outside any allocation is not defined to be harmless); a tensor's last, partial block is
    # loaded without one.
    whole = first + tl.minimum(count, numel // (GROUPS * 32) - first)  # blocks below this one are whole
    if PREFETCH != 0 and (ALIGNED or not QUANTIZED):
        line0, step = _prefetch_lines(p_addr, g_addr, m_addr, v_addr, rho_addr, P_KIND, G_KIND, RHO_KIND,
                                      QUANTIZED, ALGO, HAS_M, GROUPS, PREFETCH)
        for j in tl.static_range(1, AHEAD):  # the blocks before the first one the loop asks for
            if first + j < whole:
                _prefetch_block(line0, step, first + j, LEVEL)
    for j in range(count):
        if PREFETCH != 0 and (ALIGNED or not QUANTIZED):
            if first + j + AHEAD < whole:
                _prefetch_block(line0, step, first + j + AHEAD, LEVEL)
        bad += _step_block(
            p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, first + j,
            numel, ngroups, cols, gpr,
            beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
            P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, ALGO,
            HAS_M, NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS,
        )
    if COUNT_SKIPPED:
        n_bad = tl.sum(bad)
        tl.atomic_add(skipped_ptr, n_bad, mask=n_bad > 0, sem="relaxed")


# ----- the two launch styles -------------------------------------------------------------------------------


@triton.jit
def _table_kernel(
    work_ptr,  # int32 (items, 3): (tensor index, first block, number of blocks) of each program
    tensors_ptr,  # int64 (tensors, TABLE_STRIDE): addresses of p, g, m, v, ms, vs, rho; numel, ngroups, cols, gpr
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,
):
    item = tl.program_id(0)
    t = tl.load(work_ptr + 3 * item)
    first = tl.load(work_ptr + 3 * item + 1)
    count = tl.load(work_ptr + 3 * item + 2)
    row = tensors_ptr + t.to(tl.int64) * _TABLE_STRIDE
    p_addr, g_addr, m_addr, v_addr = tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    ms_addr, vs_addr, rho_addr = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    # table tensors have fewer than LARGE_NUMEL (< 2^31) elements: int32 index arithmetic
    numel, ngroups = tl.load(row + 7).to(tl.int32), tl.load(row + 8).to(tl.int32)
    cols, gpr = tl.load(row + 9).to(tl.int32), tl.load(row + 10).to(tl.int32)
    # several consecutive blocks of one tensor per program: the chain of dependent loads above (work item,
    # then the tensor's row) is paid once for all of them
    _step_blocks(
        p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr, first, count,
        numel, ngroups, cols, gpr,
        beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, ALGO,
        HAS_M, NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS, PREFETCH, AHEAD, LEVEL,
    )


@triton.jit
def _tensor_kernel(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int addresses of one tensor's data (0: none)
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    nblocks,  # blocks of GROUPS groups in the tensor
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,
    BLOCKS: tl.constexpr,  # consecutive blocks per program
    WIDE: tl.constexpr,  # numel >= 2^31: int64 index arithmetic
):
    first = tl.program_id(0)
    if WIDE:
        first = first.to(tl.int64)
    first = first * BLOCKS
    count = tl.minimum(nblocks - first, BLOCKS)
    _step_blocks(
        p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr, first, count,
        numel, ngroups, cols, gpr,
        beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, inv_bc2_sqrt,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, ALGO, HAS_M,
        NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS, PREFETCH, AHEAD, LEVEL,
    )


# ----- host side: plans (buckets, tables) and launches -----------------------------------------------------

# TRITON_INTERPRET was set when triton was imported: kernels run in numpy, which has no libdevice
_INTERPRETED = not isinstance(_table_kernel, triton.runtime.JITFunction)


class _Bucket:
    """Tensors of one specialisation: one table launch for the small ones, one launch each for the large."""

    __slots__ = ("flags", "work", "tensors", "rows", "small", "items", "large")

    def __init__(self, flags: dict):
        self.flags = flags  # the constexpr arguments fixed by the tensors (dtypes, alignment, rho constants)
        self.work = None  # device int32 (items, 3) work table of the small tensors, or None
        self.tensors = None  # device int64 (small tensors, TABLE_STRIDE) table
        self.rows = None  # the same table on the host, kept to rewrite gradient addresses
        self.small = []  # index in the call's lists of each table row
        self.items = 0  # programs of the table launch
        self.large = []  # [index, grid, address and size arguments, WIDE] of each large tensor


class _Plan:
    __slots__ = ("buckets", "dummy", "exp_avg_table", "device", "layout", "param_ptrs", "numels", "grad_dtypes",
                 "grad_ptrs", "state_ids", "refs", "streams", "__weakref__")

    def __init__(self, buckets, device, layout, param_ptrs, numels, grad_dtypes, grad_ptrs):
        self.buckets = buckets
        self.device = device
        self.dummy = torch.zeros(1, dtype=torch.int32, device=device)  # skip counter when none is counted
        self.exp_avg_table = Q.exp_avg_table(device)
        self.layout = layout  # (quantized, rho dtype, cols, module constants): with param_ptrs, the cache key
        self.param_ptrs = param_ptrs
        self.numels = numels  # of each tensor in the call's lists
        self.grad_dtypes = grad_dtypes
        self.grad_ptrs = grad_ptrs  # gradient addresses the tables hold
        self.state_ids: list[int] = []
        self.refs: list[weakref.ref] = []  # weak references to the state tensors that drop this plan when freed
        self.streams: list = []  # streams the device tables are marked as used on

    def used_on(self, stream) -> None:
        """Mark the plan's device tables as read by work queued on ``stream`` (caching allocator). Once per
        stream is enough: when a table is freed, the allocator waits for everything queued on its marked
        streams up to then. Tables rebuilt by ``set_grads`` are new tensors, marked again."""
        if stream in self.streams:
            return
        self.streams.append(stream)
        self.dummy.record_stream(stream)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.record_stream(stream)
                bucket.tensors.record_stream(stream)

    def watch(self, first: Sequence[torch.Tensor], states: list[Sequence[torch.Tensor]]) -> None:
        """Record the ids of the ``first`` state list (the first moments), and drop the plan from the cache as
        soon as any state tensor is freed (after which the plan would point at freed memory, and its id may
        name a new tensor)."""
        this = weakref.ref(self)

        def freed(_ref, this=this):
            plan = this()
            if plan is not None and plan in _PLANS:
                _PLANS.remove(plan)

        self.state_ids = list(map(id, first))
        self.refs = [weakref.ref(t, freed) for kind in states for t in kind]

    def set_grads(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> bool:
        """Point the tables at new gradient tensors; False when the plan does not fit them (other dtype or
        alignment, or another number of tensors), so that it is rebuilt."""
        if len(grads) != len(self.numels):
            return False
        floats = tuple(_FLOAT_KIND)
        aligned16 = {}
        for bucket in self.buckets:
            for i in bucket.small:
                aligned16[i] = bucket.flags["ALIGN16"]
            for large in bucket.large:
                aligned16[large[0]] = bucket.flags["ALIGN16"]
        for i, (new, old) in enumerate(zip(ptrs, self.grad_ptrs)):
            if new != old:
                _check(i, "grad", grads[i], self.numels[i], floats, self.device)
                if grads[i].dtype != self.grad_dtypes[i] or (aligned16.get(i, False) and new % 16):
                    return False
        for bucket in self.buckets:
            if bucket.small and any(ptrs[i] != self.grad_ptrs[i] for i in bucket.small):
                rows = bucket.rows.clone()
                rows[:, _GRAD_COLUMN] = torch.tensor([ptrs[i] for i in bucket.small], dtype=torch.int64)
                bucket.rows, bucket.tensors = rows, _to_device(rows, self.device)
                self.streams = []  # a new device table: mark it on the streams that will read it
            for large in bucket.large:
                large[2][_GRAD_COLUMN] = ptrs[large[0]]
        self.grad_ptrs = ptrs
        return True


# Cached plans, most recently used first. A list, not a dict keyed by the parameter addresses: comparing
# lists of ints stops at the first difference, where hashing a key walks all of it.
_PLANS: list[_Plan] = []


def _find_plan(layout: tuple, param_ptrs: list[int], first: Sequence[torch.Tensor]) -> _Plan | None:
    ids = None
    for plan in _PLANS:
        if plan.param_ptrs == param_ptrs and plan.layout == layout:
            if ids is None:
                ids = list(map(id, first))
            if plan.state_ids == ids:
                return plan
    return None


def _check(i: int, what: str, t: torch.Tensor, numel: int, dtypes: tuple, device: torch.device) -> None:
    where = f"flashdist: {what} of tensor {i}"
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, the parameters on {device}: one call takes one device")
    if t.dtype not in dtypes:
        raise TypeError(f"{where} has dtype {t.dtype}, expected one of {dtypes}")
    if t.numel() != numel:
        raise ValueError(f"{where} has {t.numel()} elements (shape {tuple(t.shape)}), expected {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{where} is not contiguous (strides {t.stride()}); the fused step reads flat storage")


def _build_plan(layout, param_ptrs, params, grads, moments, scales, rhos, cols) -> _Plan:
    """``moments``: the call's moment lists (none, the first, or Adam's first and second); ``scales`` their
    scale lists when quantized, else None."""
    device = params[0].device
    quantized = scales is not None
    lists = {"grads": grads, "rhos": rhos, "cols": cols if quantized else None}
    for k, values in enumerate(moments):
        lists[f"moments[{k}]"] = values
        lists[f"scales[{k}]"] = scales[k] if quantized else None
    for name, values in lists.items():
        if values is not None and len(values) != len(params):
            raise ValueError(f"flashdist: {len(params)} params but {len(values)} {name}")
    names = ("first moment", "second moment")
    floats = tuple(_FLOAT_KIND)
    buckets: dict[tuple, _Bucket] = {}
    small: dict[tuple, list[tuple]] = {}  # bucket key -> (index, table row, blocks) of each small tensor
    for i, p in enumerate(params):
        n = p.numel()
        _check(i, "param", p, n, floats, device)
        _check(i, "grad", grads[i], n, floats, device)
        # addresses of p, g, m, v, their scales, rho (0: none)
        data = [p, grads[i], *(m[i] for m in moments), *[None] * (2 - len(moments))]
        if quantized:
            c = int(cols[i])
            if c <= 0 or n % c:
                raise ValueError(f"flashdist: tensor {i} has {n} elements, not a whole number of rows of {c}")
            gpr = -(-c // Q.GROUP)
            ngroups = n // c * gpr
            for k, (m, sc) in enumerate(zip(moments, scales)):
                _check(i, f"{names[k]} codes", m[i], n, (torch.uint8,) if k else (torch.int8,), device)
                _check(i, f"{names[k]} scales", sc[i], ngroups, (torch.bfloat16,), device)
            data += [*(sc[i] for sc in scales), *[None] * (2 - len(scales))]
            aligned = c % Q.GROUP == 0
            table_blocks, large_blocks = -(-ngroups // TABLE_GROUPS), -(-ngroups // LARGE_GROUPS)
        else:
            c, gpr, ngroups = n, 0, n
            for k, m in enumerate(moments):
                _check(i, names[k], m[i], n, (torch.float32,), device)
            data += [None, None]
            aligned = True  # not read without quantization
            table_blocks = -(-n // (TABLE_GROUPS * Q.GROUP))
            large_blocks = -(-n // (LARGE_GROUPS * Q.GROUP))
        rho_dtype = None
        if rhos is not None:
            if p.dtype not in (torch.bfloat16, torch.float16):
                raise TypeError(f"flashdist: tensor {i} has a rho but its param is {p.dtype}; only bf16 and "
                                "fp16 params are split")
            _check(i, "rho", rhos[i], n, (rhos[0].dtype,), device)
            rho_dtype = rhos[i].dtype
        data.append(rhos[i] if rhos is not None else None)
        if n == 0:
            continue
        addrs = [t.data_ptr() if t is not None else 0 for t in data]
        align16 = all(a % 16 == 0 for a in addrs)
        key = (p.dtype, grads[i].dtype, aligned, align16)
        if key not in buckets:
            buckets[key] = _Bucket(dict(
                P_KIND=_FLOAT_KIND[p.dtype], G_KIND=_FLOAT_KIND[grads[i].dtype], RHO_KIND=_RHO_KIND[rho_dtype],
                QUANTIZED=quantized, ALIGNED=aligned, ALIGN16=align16, RHO_LOG2=_RHO_LOG2[rho_dtype],
            ))
        sizes = [n, ngroups, c, gpr]
        if n >= LARGE_NUMEL or n >= 2**31:  # the table launch indexes with int32
            grid = (-(-large_blocks // LARGE_BLOCKS),)
            buckets[key].large.append([i, grid, [*addrs, *sizes, large_blocks], n >= 2**31])
        else:
            small.setdefault(key, []).append((i, addrs + sizes, table_blocks))
    for key, rows in small.items():
        table = torch.zeros((len(rows), _TABLE_STRIDE.value), dtype=torch.int64)
        table[:, :_TABLE_FIELDS] = torch.tensor([row for _, row, _ in rows], dtype=torch.int64)
        # items of up to TABLE_BLOCKS blocks of one tensor: item k of a tensor starts at block k * TABLE_BLOCKS
        nblocks = torch.tensor([blocks for _, _, blocks in rows], dtype=torch.int64)
        nitems = -(-nblocks // TABLE_BLOCKS)
        index = torch.repeat_interleave(torch.arange(len(rows)), nitems)
        k = torch.arange(len(index)) - torch.repeat_interleave(torch.cumsum(nitems, 0) - nitems, nitems)
        first = k * TABLE_BLOCKS
        work = torch.stack([index, first, torch.minimum(nblocks[index] - first, torch.tensor(TABLE_BLOCKS))],
                           dim=1).to(torch.int32)
        bucket = buckets[key]
        bucket.small = [i for i, _, _ in rows]
        bucket.rows = table
        bucket.work, bucket.tensors, bucket.items = _to_device(work, device), _to_device(table, device), len(work)
    return _Plan(list(buckets.values()), device, layout, param_ptrs, [p.numel() for p in params],
                 [g.dtype for g in grads], list(map(_data_ptr, grads)))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # no wait for the work queued before the step


def _step_multi(algo: int, params, grads, moments: list, scales: list | None, rhos, cols, scalars: tuple, *,
                companded: bool, decoupled: bool, nesterov: bool, skipped: torch.Tensor | None) -> None:
    """One step of update ``algo`` on every tensor of the lists: one launch per bucket (see the module doc).
    ``scalars``: the kernel's nine fp32 scalars, in its order."""
    if not params:
        return
    device = params[0].device
    quantized = scales is not None
    layout = (device, algo, len(moments), quantized, rhos[0].dtype if rhos is not None else None,
              list(cols) if quantized else None, LARGE_NUMEL, TABLE_GROUPS, TABLE_BLOCKS, LARGE_GROUPS, LARGE_BLOCKS)
    param_ptrs = list(map(_data_ptr, params))
    grad_ptrs = list(map(_data_ptr, grads))
    # The first state list identifies the state (a replaced state tensor gets a new plan). Without any state
    # (SGD without momentum on parameters without rho) the parameters themselves are watched: a plan must
    # not outlive the tensors whose sizes its tables hold, since another tensor may take the same address.
    first_state = moments[0] if moments else (rhos if rhos is not None else params)
    plan = _find_plan(layout, param_ptrs, first_state)
    if plan is not None and grad_ptrs != plan.grad_ptrs and not plan.set_grads(grads, grad_ptrs):
        _PLANS.remove(plan)
        plan = None
    if plan is None:
        plan = _build_plan(layout, param_ptrs, params, grads, moments, scales, rhos, cols)
        states = [*moments, *(scales or [])]
        if rhos is not None:
            states.append(rhos)
        plan.watch(first_state, states or [params])
        _PLANS.insert(0, plan)
        del _PLANS[PLAN_CACHE_SIZE:]
    elif _PLANS[0] is not plan:
        _PLANS.remove(plan)
        _PLANS.insert(0, plan)

    if skipped is not None and (skipped.dtype != torch.int32 or skipped.device != device):
        raise ValueError(f"flashdist: skipped must be an int32 tensor on {device}, got {skipped.dtype} on "
                         f"{skipped.device}")
    counter = plan.dummy if skipped is None else skipped
    if device.type == "cuda":
        # the plan's device tables may have been allocated on another stream (gradient release steps on a
        # side stream): keep their memory from being reused there while this launch may still read them
        plan.used_on(torch.cuda.current_stream(device))
    # Adam's update divides 8-bit groups' scaled first moments (0, or magnitudes in [2^-48, 4)) by denominators
    # in [eps, 2^64 c2 + eps] (c2 = 1/sqrt(1 - beta2^t)): with these scalars (eps, c2: the kernel's 5th and
    # 9th) the quotients lie in [2^-125, 2^124], _div_normalized's range
    eps, c2 = scalars[4], scalars[8]
    fast_update = algo == ADAM and _UPDATE_EPS_MIN <= eps <= _UPDATE_SCALAR_MAX and c2 <= _UPDATE_SCALAR_MAX
    for bucket in plan.buckets:
        flags = dict(bucket.flags, COMPANDED=companded, DECOUPLED=decoupled, COUNT_SKIPPED=skipped is not None,
                     ALGO=algo, HAS_M=bool(moments), NESTEROV=nesterov, EXACT=EXACT,
                     COMPILED=not _INTERPRETED, FAST_UPDATE=fast_update, AHEAD=PREFETCH_AHEAD,
                     LEVEL=PREFETCH_LEVEL,
                     **compile_options(EXACT, bucket.flags["QUANTIZED"]))
        if bucket.items:
            _table_kernel[(bucket.items,)](bucket.work, bucket.tensors, plan.exp_avg_table, counter, *scalars,
                                           GROUPS=TABLE_GROUPS, PREFETCH=_prefetch_slots(flags, TABLE_GROUPS),
                                           **flags)
        for _, grid, args, wide in bucket.large:
            _tensor_kernel[grid](*args[:7], plan.exp_avg_table, counter, *args[7:], *scalars, GROUPS=LARGE_GROUPS,
                                 PREFETCH=_prefetch_slots(flags, LARGE_GROUPS), BLOCKS=LARGE_BLOCKS, WIDE=wide,
                                 **flags)


def compile_options(exact: bool = True, quantized: bool = True) -> dict:
    """The compiler options of a launch of the ``exact`` (or approximate) variant on 8-bit (or fp32) moments,
    from the module constants: warps per program, no FMA contraction (the reference's products and sums stay
    separate), and the register cap when one is set."""
    options = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)
    cap = MAX_REGISTERS if MAX_REGISTERS is not None or exact or not quantized else APPROX_MAX_REGISTERS
    if cap is not None:
        options["maxnreg"] = cap
    return options


def _prefetch_slots(flags: dict, groups: int) -> int:
    """The kernel's PREFETCH: 0 (none) or a power of two at least the 128-byte lines of one block's
    per-value streams (``_prefetch_block``)."""
    if not PREFETCH or _INTERPRETED or (flags["QUANTIZED"] and not flags["ALIGNED"]):
        return 0  # the interpreter has no inline assembly; unaligned rows make blocks ragged
    slots = groups * Q.GROUP
    float_bytes = {0: 2, 1: 2, 2: 4}
    moment_bytes = 1 if flags["QUANTIZED"] else 4
    moments = (2 if flags["ALGO"] == ADAM else 1) if flags["HAS_M"] else 0
    lines = sum(slots * b // 128 for b in (float_bytes[flags["P_KIND"]], float_bytes[flags["G_KIND"]],
                                             flags["RHO_KIND"], *[moment_bytes] * moments))
    return 1 << max(lines - 1, 0).bit_length() if lines else 0


def adam_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor] | None,
    exp_avg_sq_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    scalars: AdamScalars,
    companded: bool,
    skipped: torch.Tensor | None,
) -> None:
    """``reference.adam_step_`` on every tensor of the lists, in one launch per bucket (see the module doc).

    Lists may mix param dtypes (bf16/fp16/fp32) and grad dtypes; ``rhos``, when given, holds one rho per
    parameter, all of one dtype (int8 or int16). ``skipped`` is a 0-dim int32 tensor on the parameters'
    device, or None. Every tensor must be contiguous (checked when the launch plan is built, and for a
    gradient whenever its address changes).
    """
    sc = scalars
    args = (sc.beta1, sc.beta2, sc.one_minus_beta1, sc.one_minus_beta2, sc.eps, sc.weight_decay, sc.decay,
            sc.step_size, sc.inv_bias_correction2_sqrt)
    scales = [exp_avg_scales, exp_avg_sq_scales] if exp_avg_scales is not None else None
    _step_multi(ADAM, params, grads, [exp_avgs, exp_avg_sqs], scales, rhos, cols, args, companded=companded,
                decoupled=sc.decoupled, nesterov=False, skipped=skipped)


def sgd_step_multi(params, grads, momentum_buffers, momentum_scales, rhos, *, cols, scalars: SGDScalars,
                   companded: bool, skipped: torch.Tensor | None) -> None:
    """``reference.sgd_step_`` on every tensor of the lists (``momentum_buffers`` None: no momentum), in one
    launch per bucket; arguments as ``adam_step_multi``."""
    sc = scalars
    args = (sc.momentum_decay, sc.momentum, sc.momentum_gain, 0.0, 0.0, sc.weight_decay, sc.decay, sc.lr, 0.0)
    moments = [momentum_buffers] if momentum_buffers is not None else []
    scales = [momentum_scales] if momentum_scales is not None else None
    _step_multi(SGD, params, grads, moments, scales, rhos, cols, args, companded=companded,
                decoupled=sc.decoupled, nesterov=sc.nesterov, skipped=skipped)


def lion_step_multi(params, grads, exp_avgs, exp_avg_scales, rhos, *, cols, scalars: LionScalars,
                    companded: bool, skipped: torch.Tensor | None) -> None:
    """``reference.lion_step_`` on every tensor of the lists, in one launch per bucket; arguments as
    ``adam_step_multi``."""
    sc = scalars
    args = (sc.beta1, sc.beta2, sc.one_minus_beta1, sc.one_minus_beta2, 0.0, 0.0, sc.decay, sc.lr, 0.0)
    scales = [exp_avg_scales] if exp_avg_scales is not None else None
    _step_multi(LION, params, grads, [exp_avgs], scales, rhos, cols, args, companded=companded, decoupled=True,
                nesterov=False, skipped=skipped)
