"""Fused multi-tensor FlashAdam(W) step in Triton: the CUDA path behind ``flashdist.functional.flash_adam``.

Semantics. ``adam_step_multi`` does, on every tensor of its lists, exactly what ``reference.adam_step_``
does, operation by operation and with the same fp32 scalars: under ``TRITON_INTERPRET=1`` the results are
bitwise equal. To keep that promise on every backend the kernel
- moves bf16 through its bits: loads them as int16 and widens them, and rounds fp32 to bf16 with an integer
  round-to-nearest-even on the fp32 bit pattern (the interpreter's ``.to(tl.bfloat16)`` truncates);
- divides and takes square roots with ``tl.div_rn`` / ``tl.sqrt_rn`` (IEEE, like torch; Triton's ``/`` and
  ``tl.sqrt`` are approximate on the GPU);
- is compiled with ``enable_fp_fusion=False``, so no ``a * b + c`` of the reference becomes an FMA.

Layout of the work. Each program handles ``GROUPS`` groups of 32 slots, as a ``(GROUPS, 32)`` block: the
group absmax of a scale is a ``tl.max`` over axis 1, a group's "gradient not finite" flag a max over the
same axis, and no reshape is needed. For quantized moments the block walks GROUP space: group ``gid`` is
group ``gid % gpr`` of row ``gid // gpr`` (``gpr = ceil(cols / 32)``); its slot ``j`` is element
``row * cols + (gid % gpr) * 32 + j``, masked past the end of the row; its scale is ``scales[gid]``. When
``cols`` is a multiple of 32 (``ALIGNED``) the element offsets are simply ``gid * 32 + j``, contiguous and
masked per whole group, so the loads vectorise. For fp32 moments the block is 32 * GROUPS consecutive
elements and each element is its own "group" (skip flag, skip count).

Launches. Tensors are sorted into buckets of one compile-time specialisation (param dtype, grad dtype, rho
dtype, quantized, ALIGNED, 16-byte aligned storage; companded and decoupled are per call). Per bucket:
- tensors below ``LARGE_NUMEL`` elements share ONE launch over a work table of ``(tensor, block)`` items;
  each program reads its item, then the tensor's addresses and sizes from an int64 table, and tells the
  compiler the addresses are 16-byte aligned (``tl.multiple_of``), without which the loads are not
  vectorised (GPU.md measured 0.12 vs 0.5 of copy bandwidth);
- tensors of ``LARGE_NUMEL`` elements or more get a launch each, with addresses and sizes as kernel
  arguments: measured faster than the table for large tensors (no chain of dependent loads per program).
The tables live on the device and are cached, keyed by the data pointers of every tensor and the layout
(param numel, dtypes, cols); a repeated step with the same tensors only builds that key and looks it up.
Any change of storage (a new gradient buffer, a replaced parameter) gives a new key and a rebuild.

Non-finite gradients. A group whose gradient holds a NaN or an Inf is not stored (param, rho, codes,
scale keep their values); each program adds its count of such groups to ``skipped`` with one atomic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from operator import attrgetter

import torch
import triton
import triton.language as tl

from ...quant import codes as Q
from ...quant import rho as R
from ..scalars import AdamScalars

LARGE_NUMEL = 1 << 20  # tensors with at least this many elements get a launch of their own
TABLE_GROUPS = 16  # groups of 32 slots per program in the table launch (512 slots)
LARGE_GROUPS = 32  # groups of 32 slots per program in a per-tensor launch (1024 slots)
NUM_WARPS = 4
PLAN_CACHE_SIZE = 32  # cached launch plans (a few per optimizer: one per bucket of step count / layout)

_GROUP = tl.constexpr(Q.GROUP)
_INV127 = tl.constexpr(Q.INV127)
_INV255 = tl.constexpr(Q.INV255)
_FP32_EXP_MASK = tl.constexpr(0x7F800000)
_BF16_NAN = tl.constexpr(0x7FC0)  # what torch's fp32 -> bf16 conversion gives for any NaN

# dtype codes of the kernel's constexpr arguments
_FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_RHO_KIND = {None: 0, torch.int8: 1, torch.int16: 2}
# Row of the per-tensor int64 table of the table launch: the 7 addresses (p, g, m, v, ms, vs, rho), then
# numel, ngroups, cols, gpr; padded to 16 entries so that one row is one 128-byte line.
_TABLE_FIELDS = 11
_TABLE_STRIDE = tl.constexpr(16)

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_dtype = attrgetter("dtype")


# ----- elementwise helpers ---------------------------------------------------------------------------------


@triton.jit
def _bf16_bits_to_f32(bits):
    """int16 bit pattern of a bf16 value -> the fp32 value (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x):
    """fp32 -> upper 16 bits (int32) of the nearest bf16, ties to even; NaN -> 0x7FC0 like torch."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, _BF16_NAN, rounded)


@triton.jit
def _to_bf16_value(x):
    """Round fp32 to the nearest bf16, as fp32 (``codes.to_bf16_value``)."""
    return (_f32_to_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(x):
    return (x.to(tl.int32, bitcast=True) & _FP32_EXP_MASK) != _FP32_EXP_MASK


@triton.jit
def _round_half_away(x):
    r = tl.floor(tl.abs(x) + 0.5)
    return tl.where(x < 0, -r, r)


@triton.jit
def _half_ulp(tp, P_KIND: tl.constexpr):
    """``rho.half_ulp``: half the spacing of the param format (bf16 or fp16) at the fp32 value ``tp``."""
    exp = (tp.to(tl.int32, bitcast=True) >> 23) & 0xFF
    if P_KIND == 0:  # bf16: 7 mantissa bits, smallest normal biased fp32 exponent 1
        half = (tl.maximum(exp, 1) << 23).to(tl.float32, bitcast=True) * 0.00390625  # 2^-8
    else:  # fp16: 10 mantissa bits, smallest normal 2^-14
        half = (tl.maximum(exp, 127 - 14) << 23).to(tl.float32, bitcast=True) * 0.00048828125  # 2^-11
    return half


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load bf16 (through an int16 pointer), fp16 or fp32 values as fp32; 0 where masked."""
    if KIND == 0:
        return _bf16_bits_to_f32(tl.load(ptr + offs, mask=mask, other=0))
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _as_ptr(addr, KIND: tl.constexpr, ALIGN16: tl.constexpr):
    """int address -> typed pointer, hinted 16-byte aligned when ALIGN16 (the host checked it). Kinds:
    0 bf16 (read as int16 bits), 1 fp16, 2 fp32, 3 int8, 4 uint8, 5 int16."""
    addr = addr.to(tl.int64)
    if KIND == 0:
        ptr = addr.to(tl.pointer_type(tl.int16))
    elif KIND == 1:
        ptr = addr.to(tl.pointer_type(tl.float16))
    elif KIND == 2:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif KIND == 3:
        ptr = addr.to(tl.pointer_type(tl.int8))
    elif KIND == 4:
        ptr = addr.to(tl.pointer_type(tl.uint8))
    else:
        ptr = addr.to(tl.pointer_type(tl.int16))
    if ALIGN16:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


# ----- one block of one tensor -----------------------------------------------------------------------------


@triton.jit
def _step_block(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int64 addresses of one tensor's data
    skipped_ptr,  # int32 counter of skipped groups (only used with COUNT_SKIPPED)
    blk,  # block index inside the tensor
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    RHO_KIND: tl.constexpr,  # 0 no rho, 1 int8, 2 int16
    QUANTIZED: tl.constexpr,  # 8-bit moments with bf16 group scales (else fp32 moments)
    ALIGNED: tl.constexpr,  # cols is a multiple of 32
    ALIGN16: tl.constexpr,  # every address is a multiple of 16 bytes
    COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr, COUNT_SKIPPED: tl.constexpr,
    RHO_MAX: tl.constexpr, RHO_INV: tl.constexpr,  # 127.0 / 32767.0 and rho.RHO_INV
    GROUPS: tl.constexpr,  # groups of 32 slots in this block
):
    p_ptr = _as_ptr(p_addr, P_KIND, ALIGN16)
    g_ptr = _as_ptr(g_addr, G_KIND, ALIGN16)
    if QUANTIZED:
        m_ptr = _as_ptr(m_addr, 3, ALIGN16)
        v_ptr = _as_ptr(v_addr, 4, ALIGN16)
        ms_ptr = _as_ptr(ms_addr, 0, ALIGN16)
        vs_ptr = _as_ptr(vs_addr, 0, ALIGN16)
    else:
        m_ptr = _as_ptr(m_addr, 2, ALIGN16)
        v_ptr = _as_ptr(v_addr, 2, ALIGN16)
    if RHO_KIND == 1:
        rho_ptr = _as_ptr(rho_addr, 3, ALIGN16)
    elif RHO_KIND == 2:
        rho_ptr = _as_ptr(rho_addr, 5, ALIGN16)

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

    g = _load_f32(g_ptr, offs, mask, G_KIND)
    nonfinite = (~_is_finite(g)).to(tl.int32)
    if QUANTIZED:
        bad_group = tl.max(nonfinite, axis=1)
        keep = mask & (bad_group[:, None] == 0)
        n_bad = tl.sum(bad_group)
    else:
        keep = mask & (nonfinite == 0)
        n_bad = tl.sum(nonfinite)

    if QUANTIZED:
        y = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.float32) * _INV127
        if COMPANDED:
            y = tl.div_rn(y, 2.0 - tl.abs(y))
        m = y * _bf16_bits_to_f32(tl.load(ms_ptr + gid, mask=gvalid, other=0))[:, None]
        v = (tl.load(v_ptr + offs, mask=mask, other=0).to(tl.float32) * _INV255) \
            * _bf16_bits_to_f32(tl.load(vs_ptr + gid, mask=gvalid, other=0))[:, None]
        if COMPANDED:
            v = v * v
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    tp = _load_f32(p_ptr, offs, mask, P_KIND)
    if RHO_KIND != 0:
        rho = tl.load(rho_ptr + offs, mask=mask, other=0).to(tl.float32)
        theta = tp + (rho * _half_ulp(tp, P_KIND)) * RHO_INV
    else:
        theta = tp

    if DECOUPLED:
        theta = theta * decay
    else:
        g = g + theta * weight_decay
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    u = tl.sqrt_rn(v)
    denom = tl.div_rn(u, bias_correction2_sqrt) + eps
    theta = theta - tl.div_rn(m, denom) * step_size

    if QUANTIZED:
        scale = _to_bf16_value(tl.max(tl.where(mask, tl.abs(m), 0.0), axis=1))
        y = tl.div_rn(m, tl.where(scale > 0, scale, 1.0)[:, None])
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
        if COMPANDED:
            y = tl.div_rn(2.0 * y, 1.0 + tl.abs(y))
        tl.store(m_ptr + offs, _round_half_away(y * 127.0).to(tl.int8), mask=keep)
        tl.store(ms_ptr + gid, _f32_to_bf16_bits(scale).to(tl.int16), mask=gvalid & (bad_group == 0))
        if COMPANDED:
            x = u
        else:
            x = v
        scale = _to_bf16_value(tl.max(tl.where(mask, x, 0.0), axis=1))
        y = tl.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
        y = tl.minimum(tl.maximum(y, 0.0), 1.0)
        tl.store(v_ptr + offs, _round_half_away(y * 255.0).to(tl.uint8), mask=keep)
        tl.store(vs_ptr + gid, _f32_to_bf16_bits(scale).to(tl.int16), mask=gvalid & (bad_group == 0))
    else:
        tl.store(m_ptr + offs, m, mask=keep)
        tl.store(v_ptr + offs, v, mask=keep)

    if P_KIND == 0:
        low_bits = _f32_to_bf16_bits(theta)
        tl.store(p_ptr + offs, low_bits.to(tl.int16), mask=keep)
        low = (low_bits << 16).to(tl.float32, bitcast=True)
    elif P_KIND == 1:
        low16 = theta.to(tl.float16)
        tl.store(p_ptr + offs, low16, mask=keep)
        low = low16.to(tl.float32)
    else:
        tl.store(p_ptr + offs, theta, mask=keep)
    if RHO_KIND != 0:
        q = tl.div_rn(theta - low, _half_ulp(low, P_KIND)) * RHO_MAX
        q = _round_half_away(tl.where(_is_finite(q), q, 0.0))
        q = tl.minimum(tl.maximum(q, -RHO_MAX), RHO_MAX)
        if RHO_KIND == 1:
            tl.store(rho_ptr + offs, q.to(tl.int8), mask=keep)
        else:
            tl.store(rho_ptr + offs, q.to(tl.int16), mask=keep)

    if COUNT_SKIPPED:
        tl.atomic_add(skipped_ptr, n_bad, mask=n_bad > 0, sem="relaxed")


# ----- the two launch styles -------------------------------------------------------------------------------


@triton.jit
def _adam_table_kernel(
    work_ptr,  # int32 (items, 2): (tensor index, block index) of each program
    tensors_ptr,  # int64 (tensors, TABLE_STRIDE): addresses of p, g, m, v, ms, vs, rho; numel, ngroups, cols, gpr
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, RHO_MAX: tl.constexpr, RHO_INV: tl.constexpr, GROUPS: tl.constexpr,
):
    item = tl.program_id(0)
    t = tl.load(work_ptr + 2 * item)
    blk = tl.load(work_ptr + 2 * item + 1)
    row = tensors_ptr + t.to(tl.int64) * _TABLE_STRIDE
    _step_block(
        tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
        tl.load(row + 5), tl.load(row + 6),
        skipped_ptr, blk,
        # table tensors have fewer than LARGE_NUMEL (< 2^31) elements: int32 index arithmetic
        tl.load(row + 7).to(tl.int32), tl.load(row + 8).to(tl.int32), tl.load(row + 9).to(tl.int32),
        tl.load(row + 10).to(tl.int32),
        beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, RHO_MAX, RHO_INV,
        GROUPS,
    )


@triton.jit
def _adam_tensor_kernel(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int addresses of one tensor's data (0: none)
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, RHO_MAX: tl.constexpr, RHO_INV: tl.constexpr, GROUPS: tl.constexpr,
    WIDE: tl.constexpr,  # numel >= 2^31: int64 index arithmetic
):
    blk = tl.program_id(0)
    if WIDE:
        blk = blk.to(tl.int64)
    _step_block(
        p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, skipped_ptr, blk, numel, ngroups, cols, gpr,
        beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay, step_size, bias_correction2_sqrt,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, RHO_MAX, RHO_INV,
        GROUPS,
    )


# ----- host side: plans (buckets, tables) and launches -----------------------------------------------------


class _Bucket:
    """Tensors of one specialisation: one table launch for the small ones, one launch each for the large."""

    __slots__ = ("flags", "work", "tensors", "items", "large")

    def __init__(self, flags: dict):
        self.flags = flags  # the constexpr arguments fixed by the tensors (dtypes, alignment, rho constants)
        self.work = None  # device int32 (items, 2) work table of the small tensors, or None
        self.tensors = None  # device int64 (small tensors, TABLE_STRIDE) table
        self.items = 0  # programs of the table launch
        self.large = []  # (grid, address and size arguments, WIDE) of each large tensor


class _Plan:
    __slots__ = ("buckets", "dummy")

    def __init__(self, buckets: list[_Bucket], dummy: torch.Tensor):
        self.buckets = buckets
        self.dummy = dummy  # int32 tensor passed as the skip counter when none is counted


_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()


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


def _build_plan(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, rhos, cols) -> _Plan:
    device = params[0].device
    quantized = exp_avg_scales is not None
    floats = tuple(_FLOAT_KIND)
    buckets: dict[tuple, _Bucket] = {}
    small: dict[tuple, list[tuple]] = {}  # bucket key -> (table row, blocks) of each small tensor
    for i, p in enumerate(params):
        n = p.numel()
        _check(i, "param", p, n, floats, device)
        _check(i, "grad", grads[i], n, floats, device)
        if quantized:
            c = int(cols[i])
            if c <= 0 or n % c:
                raise ValueError(f"flashdist: tensor {i} has {n} elements, not a whole number of rows of {c}")
            gpr = -(-c // Q.GROUP)
            ngroups = n // c * gpr
            _check(i, "exp_avg codes", exp_avgs[i], n, (torch.int8,), device)
            _check(i, "exp_avg_sq codes", exp_avg_sqs[i], n, (torch.uint8,), device)
            _check(i, "exp_avg scales", exp_avg_scales[i], ngroups, (torch.bfloat16,), device)
            _check(i, "exp_avg_sq scales", exp_avg_sq_scales[i], ngroups, (torch.bfloat16,), device)
            data = [p, grads[i], exp_avgs[i], exp_avg_sqs[i], exp_avg_scales[i], exp_avg_sq_scales[i]]
            aligned = c % Q.GROUP == 0
            table_blocks, large_blocks = -(-ngroups // TABLE_GROUPS), -(-ngroups // LARGE_GROUPS)
        else:
            c, gpr, ngroups = n, 0, n
            _check(i, "exp_avg", exp_avgs[i], n, (torch.float32,), device)
            _check(i, "exp_avg_sq", exp_avg_sqs[i], n, (torch.float32,), device)
            data = [p, grads[i], exp_avgs[i], exp_avg_sqs[i], None, None]
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
                QUANTIZED=quantized, ALIGNED=aligned, ALIGN16=align16,
                RHO_MAX=float(R.RHO_MAX[rho_dtype]) if rho_dtype else 0.0,
                RHO_INV=R.RHO_INV[rho_dtype] if rho_dtype else 0.0,
            ))
        sizes = [n, ngroups, c, gpr]
        if n >= LARGE_NUMEL:
            buckets[key].large.append(((large_blocks,), (*addrs, *sizes), n >= 2**31))
        else:
            small.setdefault(key, []).append((addrs + sizes, table_blocks))
    for key, rows in small.items():
        table = torch.zeros((len(rows), _TABLE_STRIDE.value), dtype=torch.int64)
        table[:, :_TABLE_FIELDS] = torch.tensor([row for row, _ in rows], dtype=torch.int64)
        nblocks = torch.tensor([blocks for _, blocks in rows], dtype=torch.int64)
        index = torch.repeat_interleave(torch.arange(len(rows)), nblocks)
        first = torch.repeat_interleave(torch.cumsum(nblocks, 0) - nblocks, nblocks)
        work = torch.stack([index, torch.arange(len(index)) - first], dim=1).to(torch.int32)
        bucket = buckets[key]
        bucket.work, bucket.tensors, bucket.items = _to_device(work, device), _to_device(table, device), len(work)
    return _Plan(list(buckets.values()), torch.zeros(1, dtype=torch.int32, device=device))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # no wait for the work queued before the step


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
    device, or None. Every tensor must be contiguous (checked when the launch plan is built).
    """
    if not params:
        return
    device = params[0].device
    quantized = exp_avg_scales is not None
    kinds = [params, grads, exp_avgs, exp_avg_sqs]
    if quantized:
        kinds += [exp_avg_scales, exp_avg_sq_scales]
    if rhos is not None:
        kinds.append(rhos)
    key = (device, quantized, rhos[0].dtype if rhos is not None else None, tuple(cols) if quantized else None,
           LARGE_NUMEL, TABLE_GROUPS, LARGE_GROUPS,
           tuple(map(_numel, params)), tuple(map(_dtype, params)), tuple(map(_dtype, grads)),
           *[tuple(map(_data_ptr, kind)) for kind in kinds])
    plan = _PLANS.get(key)
    if plan is None:
        plan = _build_plan(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, rhos, cols)
        _PLANS[key] = plan
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)

    if skipped is not None and (skipped.dtype != torch.int32 or skipped.device != device):
        raise ValueError(f"flashdist: skipped must be an int32 tensor on {device}, got {skipped.dtype} on "
                         f"{skipped.device}")
    counter = plan.dummy if skipped is None else skipped
    sc = (scalars.beta1, scalars.beta2, scalars.one_minus_beta1, scalars.one_minus_beta2, scalars.eps,
          scalars.weight_decay, scalars.decay, scalars.step_size, scalars.bias_correction2_sqrt)
    for bucket in plan.buckets:
        flags = dict(bucket.flags, COMPANDED=companded, DECOUPLED=scalars.decoupled,
                     COUNT_SKIPPED=skipped is not None, num_warps=NUM_WARPS, enable_fp_fusion=False)
        if bucket.items:
            _adam_table_kernel[(bucket.items,)](bucket.work, bucket.tensors, counter, *sc, GROUPS=TABLE_GROUPS,
                                                **flags)
        for grid, args, wide in bucket.large:
            _adam_tensor_kernel[grid](*args[:7], counter, *args[7:], *sc, GROUPS=LARGE_GROUPS, WIDE=wide, **flags)
