"""One block of one tensor: the whole update of the fused step (Adam, SGD or Lion) on ``GROUPS`` groups of
32 slots, from the loads of the block's gradient, moments, parameter and rho to the stores of their new
values, in the order of the eager reference (``reference.adam_step_``, ``sgd_step_``, ``lion_step_``).

The block is a ``(GROUPS, 32)`` array: a group's absmax (for its scale, and its "not finite" flag) is a
``tl.max`` over axis 1, and no reshape is needed. With 8-bit moments the block walks GROUP space: group
``gid`` is group ``gid % gpr`` of row ``gid // gpr`` (``gpr = ceil(cols / 32)``); its slot ``j`` is element
``row * cols + (gid % gpr) * 32 + j``, masked past the end of the row; its scale is ``scales[gid]``. When
``cols`` is a multiple of 32 (``ALIGNED``) the element offsets are simply ``gid * 32 + j``, contiguous and
masked per whole group, so that the loads vectorise. With fp32 moments the block is ``32 * GROUPS``
consecutive elements and each element is its own "group" (skip flag, skip count). The int8 codes are read 8
bytes at a time (alignment hint 8, not 16), so that every load and store of a block has the layout of the
16-byte bf16 ones and no value changes layout through shared memory.

Skipped groups. A group is not stored (param, rho, codes, scale keep their values) where
``reference._store_`` skips it, and ``step_block`` returns the count per group slot. With 8-bit moments the
flag is one comparison per group of the absmaxes the scales need anyway (``codes.scale_fits``): the new first
moment's, taken with a NaN-propagating max, is not finite exactly where the gradient is not (with coupled
weight decay, also where the parameter is not), and Adam's second moment adds its own limit to the same
predicate; fp32 moments check each value of the new last moment. SGD's new parameter is checked too (its
step has no bound): with bf16 parameters and rho inside ``split_bf16``'s general path, the only one that can
make an infinite parameter, so that the common path pays nothing; with other parameters one comparison and
select per value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bits import (ADAM_ALGO, FP32_EXP_MASK, FP32_MAX, GROUP, INV127, INV255, LIFT, SCALE_MAX, SGD_ALGO,
                   SIGNED_CODE_MAGIC, SQRT_SCALE_MAX, TINY, UNSIGNED_CODE_MAGIC, UPDATE_FLUSH, code_bits,
                   bf16_value, div_normalized, divide, f32_to_bf16_bits, gather, group_normalizer, sqrt_rn)
from .rho_bits import merge_bf16, merge_fp16, new_param


@triton.jit
def step_block(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int64 addresses of one tensor's data
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device (read with COMPANDED quantized moments only)
    blk,  # block index inside the tensor
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,  # ALGO's fp32 scalars, slot k its KERNEL_FIELDS[k] (scalars.py)
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
    FAST_UPDATE: tl.constexpr,  # eps and 1/sqrt(1 - beta2^t) let div_normalized divide Adam's update (8-bit)
    RHO_LOG2: tl.constexpr,  # log2 of rho.RHO_STEPS: 7 (int8), 15 (int16)
    GROUPS: tl.constexpr,  # groups of 32 slots in this block
):
    # ALGO's scalars by name, from their slots (kernels/scalars.py: AdamScalars, SGDScalars, LionScalars).
    # Annotated, so that the interpreter keeps each one a host float as it keeps the arguments (it makes the
    # value of a plain assignment a tensor of its own, fp64 for an fp32 subnormal); compiled, both are the
    # fp32 argument itself.
    decay: tl.float32 = sc6  # 1 - lr * weight_decay (decoupled weight decay)
    if ALGO == SGD_ALGO:
        momentum_decay: tl.float32 = sc0  # factor of the stored buffer: momentum, 0 at the first step
        momentum: tl.float32 = sc1  # Nesterov's look-ahead factor
        momentum_gain: tl.float32 = sc2  # factor of the gradient: 1 - dampening, 1 at the first step
        weight_decay: tl.float32 = sc5
        lr: tl.float32 = sc7
    else:  # Adam and Lion
        beta1: tl.float32 = sc0
        beta2: tl.float32 = sc1
        one_minus_beta1: tl.float32 = sc2
        one_minus_beta2: tl.float32 = sc3
        if ALGO == ADAM_ALGO:
            eps: tl.float32 = sc4
            weight_decay: tl.float32 = sc5
            step_size: tl.float32 = sc7  # lr / (1 - beta1^t)
            inv_bc2_sqrt: tl.float32 = sc8  # 1 / sqrt(1 - beta2^t)
        else:  # Lion: weight decay always decoupled
            lr: tl.float32 = sc7
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
        if ALGO == ADAM_ALGO:  # Adam's second moment
            v_ptr = v_addr.to(tl.int64).to(tl.pointer_type(tl.uint8))
            vs_ptr = vs_addr.to(tl.int64).to(tl.pointer_type(tl.int16))
            if ALIGN16:
                v_ptr = tl.multiple_of(v_ptr, 8)
                vs_ptr = tl.multiple_of(vs_ptr, 16)
    elif HAS_M:
        m_ptr = m_addr.to(tl.int64).to(tl.pointer_type(tl.float32))
        if ALIGN16:
            m_ptr = tl.multiple_of(m_ptr, 16)
        if ALGO == ADAM_ALGO:  # Adam's second moment
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
    lane = tl.arange(0, GROUP)
    if QUANTIZED:
        gvalid = gid < ngroups
        if ALIGNED:
            offs = gid[:, None] * GROUP + lane[None, :]
            mask = gvalid[:, None] & (lane[None, :] < GROUP)  # constant over a group: vector loads
        else:
            row = gid // gpr
            col = (gid - row * gpr)[:, None] * GROUP + lane[None, :]
            offs = row[:, None] * cols + col
            mask = gvalid[:, None] & (col < cols)
    else:
        offs = gid[:, None] * GROUP + lane[None, :]
        mask = offs < numel

    # Gradient (which elements or groups are skipped is decided below, from the new moments).
    if G_KIND == 0:
        g = bf16_value(tl.load(g_ptr + offs, mask=mask, other=0), COMPILED)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0).to(tl.float32)

    # Moments: Adam's decayed beta1 * m, SGD's momentum_decay * buffer and Adam's beta2 * v
    # (codes.dequantize_exp_avg / dequantize_exp_avg_sq with the betas as factors), Lion's m itself: each
    # code's value times one per-group multiplier. Masked slots read code 0.
    if QUANTIZED:
        m_scale = (tl.load(ms_ptr + gid, mask=gvalid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        m_code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
        if COMPANDED:
            m_mult = m_scale
        else:
            m_mult = m_scale * INV127
        if ALGO == ADAM_ALGO:
            m_mult = m_mult * beta1
        elif ALGO == SGD_ALGO:
            m_mult = m_mult * momentum_decay
        if COMPANDED:
            m = gather(table_ptr + m_code, COMPILED) * m_mult[:, None]  # y / (2 - |y|) of y = code / 127
        else:
            m = m_code.to(tl.float32) * m_mult[:, None]
    elif HAS_M:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        if ALGO == ADAM_ALGO:
            m = m * beta1
        elif ALGO == SGD_ALGO:
            m = m * momentum_decay
    if QUANTIZED and ALGO == ADAM_ALGO:
        v_scale = (tl.load(vs_ptr + gid, mask=gvalid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        v_scale = v_scale * INV255
        v_code = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
        if COMPANDED:
            v = (v_code * v_code).to(tl.float32) * ((v_scale * v_scale) * beta2)[:, None]
        else:
            v = v_code.to(tl.float32) * (v_scale * beta2)[:, None]
    elif ALGO == ADAM_ALGO:
        v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2

    # Master weight (rho.merge).
    if P_KIND == 0:
        p16 = tl.load(p_ptr + offs, mask=mask, other=0)
        if RHO_KIND != 0:
            theta = merge_bf16(p16, tl.load(rho_ptr + offs, mask=mask, other=0), RHO_LOG2, COMPILED)
        else:
            theta = bf16_value(p16, COMPILED)
    else:
        theta = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.float32)
        if RHO_KIND != 0:
            theta = merge_fp16(theta, tl.load(rho_ptr + offs, mask=mask, other=0).to(tl.int32), RHO_LOG2)

    # The update, in the reference's order (reference.adam_step_, sgd_step_, lion_step_).
    if DECOUPLED:
        theta = theta * decay
    else:
        g = g + theta * weight_decay
    if ALGO == ADAM_ALGO:
        m = m + g * one_minus_beta1
        v = v + (g * g) * one_minus_beta2
        if EXACT:
            u = sqrt_rn(v, COMPILED)
        else:
            u = tl.sqrt(v)
        denom = u * inv_bc2_sqrt + eps
        if QUANTIZED:
            # reference._adam_update: m scaled by codes.pow2_normalizer of the group's absmax, values below
            # 2^-48 taken as 0, divided, times step_size / s; the quotients lie in [2^-125, 2^124] (or are 0)
            # when FAST_UPDATE, where div_normalized needs no range check or branch. (The approximate variant
            # scales too, to stay the reference's function up to its division; docs/benchmarks.md has its cost.)
            absmax, a, e, s = group_normalizer(m, COMPILED)
            scaled = m * s[:, None]
            scaled = tl.where(tl.abs(scaled) < UPDATE_FLUSH, 0.0, scaled)
            if EXACT and FAST_UPDATE:
                quotient = div_normalized(scaled, denom, COMPILED)
            else:
                quotient = divide(scaled, denom, EXACT, COMPILED)
            theta = theta - quotient * (step_size * (e << 23).to(tl.float32, bitcast=True))[:, None]  # 1/s
        else:
            theta = theta - divide(m, denom, EXACT, COMPILED) * step_size
    elif ALGO == SGD_ALGO:
        if HAS_M:
            m = m + g * momentum_gain
            if NESTEROV:
                d = g + m * momentum
            else:
                d = m
        else:
            d = g
        theta = theta - d * lr
    else:  # Lion: the sign of an interpolation moves theta; the momentum is a second interpolation
        c = m * beta1 + g * one_minus_beta1
        theta = theta - tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0)) * lr
        m = m * beta2 + g * one_minus_beta2

    # Skipped groups (reference._store_): with 8-bit moments, those where a new moment does not fit its
    # scale (codes.scale_fits of the group absmax; the first moment's propagates a NaN, and is not finite
    # where the gradient is not); with fp32 moments, the elements whose new last moment is not finite
    # (without moments: whose gradient is not). SGD's step has no bound: its groups are skipped too where
    # the new parameter is not finite, flagged by a NaN in the momentum (or the gradient) there.
    if ALGO == SGD_ALGO:
        if HAS_M:
            p_out, r, m = new_param(theta, m, P_KIND, RHO_KIND, RHO_LOG2, True, COMPILED)
        else:
            p_out, r, g = new_param(theta, g, P_KIND, RHO_KIND, RHO_LOG2, True, COMPILED)
    if not QUANTIZED:
        if not HAS_M:
            bad = (g.to(tl.int32, bitcast=True) & FP32_EXP_MASK) == FP32_EXP_MASK
        elif ALGO == ADAM_ALGO:
            bad = ~(v <= FP32_MAX)
        else:
            bad = ~(tl.abs(m) <= FP32_MAX)
        keep = mask & ~bad
        n_bad = tl.sum(bad.to(tl.int32), axis=1)
    # New moments (codes.quantize_exp_avg / quantize_exp_avg_sq): codes against the exact group absmax
    # A, stored rounded to bf16 as the scale. Masked slots hold exact zeros (zero code, gradient and
    # param), like the reference's padding, so they need no masking in the max.
    if QUANTIZED:
        # (Adam's update computed the first moment's absmax, with a and the normalizer s below.)
        if ALGO != ADAM_ALGO:
            absmax, a, e, s = group_normalizer(m, COMPILED)
            bad_group = ~(absmax <= SCALE_MAX)
        elif COMPANDED:  # the second moment is stored as codes of u = sqrt(v)
            v_absmax = tl.max(u, axis=1)
            bad_group = ~(absmax <= SCALE_MAX) | ~(v_absmax <= SQRT_SCALE_MAX)
        else:
            v_absmax = tl.max(v, axis=1)
            bad_group = ~(absmax <= SCALE_MAX) | ~(v_absmax <= SCALE_MAX)
        keep = mask & ~bad_group[:, None]
        keep_group = gvalid & ~bad_group
        n_bad = bad_group.to(tl.int32)
        if COMPANDED:  # round(254 m / (A + |m|))
            # m and A scaled by s = codes.pow2_normalizer(A): every divisor lies in [2^-30, 8)
            n = m * (254.0 * s)[:, None]
            d = tl.fma(tl.abs(m), s[:, None], (a * s)[:, None])  # fl(|m| s + A s): |m| s is exact or negligible
            if EXACT:
                q = div_normalized(n, d, COMPILED)
            else:
                q = divide(n, d, EXACT, COMPILED)
        else:  # round(m * (127 / A)), lifted for tiny groups
            lift = tl.where(a < TINY, LIFT, 1.0)
            q = (m * lift[:, None]) * tl.div_rn(tl.full(a.shape, 127.0, tl.float32), a * lift)[:, None]
        tl.store(m_ptr + offs, code_bits(q, SIGNED_CODE_MAGIC).to(tl.int8), mask=keep)
        tl.store(ms_ptr + gid, f32_to_bf16_bits(absmax).to(tl.int16), mask=keep_group)
    if QUANTIZED and ALGO == ADAM_ALGO:
        if COMPANDED:
            # x = sqrt(v) is 0 or at least 2^-74.5 (the root of the smallest subnormal), so 255 / A cannot
            # overflow and the reference's lift by 2^64 (A < 2^-64) changes no bit: it is left out here
            absmax = v_absmax
            a = tl.where(absmax > 0, absmax, 1.0)
            q = u * tl.div_rn(tl.full(a.shape, 255.0, tl.float32), a)[:, None]
        else:
            absmax = v_absmax
            a = tl.where(absmax > 0, absmax, 1.0)
            lift = tl.where(a < TINY, LIFT, 1.0)
            q = (v * lift[:, None]) * tl.div_rn(tl.full(a.shape, 255.0, tl.float32), a * lift)[:, None]
        tl.store(v_ptr + offs, code_bits(q, UNSIGNED_CODE_MAGIC).to(tl.uint8), mask=keep)
        tl.store(vs_ptr + gid, f32_to_bf16_bits(absmax).to(tl.int16), mask=keep_group)
    elif ALGO == ADAM_ALGO:
        tl.store(v_ptr + offs, v, mask=keep)
    if HAS_M and not QUANTIZED:
        tl.store(m_ptr + offs, m, mask=keep)

    # New parameter and rho.
    if ALGO != SGD_ALGO:
        p_out, r, theta = new_param(theta, theta, P_KIND, RHO_KIND, RHO_LOG2, False, COMPILED)
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

