"""FlashMuon's elementwise phases as Triton kernels: the momentum update (phase 1) and the weight update
(phase 3) of ``reference.muon_momentum_`` and ``reference.muon_apply_``, operation by operation, so that they
give the reference's bits (under ``TRITON_INTERPRET=1`` on CPU, and on CUDA: every operation is IEEE
round-to-nearest, the lerps and the step are explicit ``tl.fma`` and nothing else is contracted into one
(``enable_fp_fusion=False``, as the fused step), the companding division is ``div_normalized`` as there).
Phase 2, Newton-Schulz, is torch's matmuls on the whole matrix (``reference.newton_schulz``).

One launch per tensor and phase (Newton-Schulz runs between the two on each matrix, so the launches cannot
share one table as the fused step's do). A captured step's momentum launches read each gradient's address
from a device cell (``G_CELL``), which ``GraphedStep`` rewrites before each replay, so that new gradients at
new addresses need no new capture. A block is ``GROUPS`` groups of 32 slots, laid out as in
``step.step_block``: group space with 8-bit momentum, element space with fp32 momentum and in phase 3. A
program walks ``BLOCKS`` consecutive blocks, asking L2 for the next one's bytes while it computes one where
``PREFETCH`` is set (``prefetch.stream_lines``), and counts its skipped values in one relaxed atomic. How
each kernel is launched is ``LaunchConfig.muon_momentum`` and ``muon_apply`` (``KernelLaunch``), from sweeps
on an H200 (``launch/bench/bench_muon.py --kernels``).

Phase 1 reads the gradient and the momentum codes (or the fp32 buffer) and writes the new codes and scales
and the update ``U`` as bf16 (what Newton-Schulz starts from): 2 + 1.0625 read, 1.0625 + 2 written per value
of a bf16 gradient. Phase 3 reads ``O`` (bf16), the parameter and rho and writes the parameter and rho:
2 + 3 read, 3 written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import codes as Q
from ..scalars import MuonScalars
from .bits import (FP32_EXP_MASK, FP32_MAX, GROUP, INV127, LIFT, SCALE_MAX, SIGNED_CODE_MAGIC, TINY, bf16_value,
                   code_bits, div_normalized, f32_to_bf16_bits, gather, group_normalizer)
from .config import KernelLaunch, current
from .device_scalars import f64, f64_bits
from .prefetch import prefetch_block, slots_for, stream_lines
from .rho_bits import merge_bf16, merge_fp16, new_param

_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_RHO = {None: (0, 7), torch.int8: (1, 7), torch.int16: (2, 15)}  # rho dtype -> (RHO_KIND, RHO_LOG2)


@triton.jit
def _momentum_block(g_ptr, m_ptr, ms_ptr, u_ptr, table_ptr, blk, numel, ngroups, cols, gpr, buf_c, nest_c,
                    G_KIND: tl.constexpr, QUANTIZED: tl.constexpr, COMPANDED: tl.constexpr, ALIGNED: tl.constexpr,
                    BUF_SMALL: tl.constexpr, NESTEROV: tl.constexpr, NEST_SMALL: tl.constexpr,
                    COMPILED: tl.constexpr, GROUPS: tl.constexpr):
    """Phase 1 on block ``blk``: ``GROUPS`` groups of 32 (8-bit momentum) or ``32 * GROUPS`` values."""
    gid = blk * GROUPS + tl.arange(0, GROUPS)
    lane = tl.arange(0, GROUP)
    if QUANTIZED:
        gvalid = gid < ngroups
        if ALIGNED:
            offs = gid[:, None] * GROUP + lane[None, :]
            mask = gvalid[:, None] & (lane[None, :] < GROUP)
        else:
            row = gid // gpr
            col = (gid - row * gpr)[:, None] * GROUP + lane[None, :]
            offs = row[:, None] * cols + col
            mask = gvalid[:, None] & (col < cols)
    else:
        offs = gid[:, None] * GROUP + lane[None, :]
        mask = offs < numel
    if G_KIND == 0:
        g = bf16_value(tl.load(g_ptr + offs, mask=mask, other=0), COMPILED)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0).to(tl.float32)
    if QUANTIZED:  # codes.dequantize_exp_avg with factor 1
        scale = (tl.load(ms_ptr + gid, mask=gvalid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
        if COMPANDED:
            buf = gather(table_ptr + code, COMPILED) * scale[:, None]
        else:
            buf = code.to(tl.float32) * (scale * INV127)[:, None]
    else:
        buf = tl.load(m_ptr + offs, mask=mask, other=0.0)
    # reference.lerp_: one fused multiply-add each
    if BUF_SMALL:
        buf = tl.fma(g - buf, buf_c, buf)
    else:
        buf = tl.fma(g - buf, buf_c, g)
    if NESTEROV:
        if NEST_SMALL:
            u = tl.fma(buf - g, nest_c, g)
        else:
            u = tl.fma(buf - g, nest_c, buf)
    else:
        u = buf
    tl.store(u_ptr + offs, f32_to_bf16_bits(u).to(tl.int16), mask=mask)
    if QUANTIZED:  # codes.quantize_exp_avg, where the new buffer fits its scale (as step.step_block)
        absmax, a, e, s = group_normalizer(buf, COMPILED)
        bad_group = ~(absmax <= SCALE_MAX)
        keep = mask & ~bad_group[:, None]
        if COMPANDED:
            n = buf * (254.0 * s)[:, None]
            d = tl.fma(tl.abs(buf), s[:, None], (a * s)[:, None])
            q = div_normalized(n, d, COMPILED)
        else:
            lift = tl.where(a < TINY, LIFT, 1.0)
            q = (buf * lift[:, None]) * tl.div_rn(tl.full(a.shape, 127.0, tl.float32), a * lift)[:, None]
        tl.store(m_ptr + offs, code_bits(q, SIGNED_CODE_MAGIC).to(tl.int8), mask=keep)
        tl.store(ms_ptr + gid, f32_to_bf16_bits(absmax).to(tl.int16), mask=gvalid & ~bad_group)
    else:
        tl.store(m_ptr + offs, buf, mask=mask & (tl.abs(buf) <= FP32_MAX))


@triton.jit
def _momentum_kernel(
    g_ptr, m_ptr, ms_ptr, u_ptr,  # gradient (bf16 as int16 bits, fp16, fp32); codes or fp32 buffer; scales; U
    table_ptr,  # fp32 codes.EXP_AVG_TABLE (companded codes only)
    numel, ngroups, cols, gpr, nblocks,  # elements; groups; row length; groups per row (8-bit momentum); blocks
    buf_coef, nest_coef,  # lerp coefficients: w (small weight) or w - 1 (MuonScalars)
    G_KIND: tl.constexpr, QUANTIZED: tl.constexpr, COMPANDED: tl.constexpr, ALIGNED: tl.constexpr,
    BUF_SMALL: tl.constexpr, NESTEROV: tl.constexpr, NEST_SMALL: tl.constexpr, COMPILED: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCKS: tl.constexpr,  # consecutive blocks per program
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,  # as programs.step_blocks'
    G_CELL: tl.constexpr = False,  # g_ptr points at an int64 cell holding the gradient's address
):
    buf_c: tl.float32 = buf_coef  # (annotated: the interpreter keeps a host float as it keeps the arguments)
    nest_c: tl.float32 = nest_coef
    if G_CELL:  # (a captured step: the address is written before each replay, optim.graph.GraphedStep)
        g_addr = tl.load(g_ptr).to(tl.int64)
        if G_KIND == 0:
            g_ptr = tl.multiple_of(g_addr.to(tl.pointer_type(tl.int16)), 16)
        elif G_KIND == 1:
            g_ptr = tl.multiple_of(g_addr.to(tl.pointer_type(tl.float16)), 16)
        else:
            g_ptr = tl.multiple_of(g_addr.to(tl.pointer_type(tl.float32)), 16)
    first = tl.program_id(0) * BLOCKS
    count = tl.minimum(nblocks - first, BLOCKS)
    if PREFETCH != 0:  # whole blocks only (programs.step_blocks): the gradient's and the momentum's lines
        whole = first + tl.minimum(count, numel // (GROUPS * 32) - first)
        line0, step = stream_lines(g_ptr.to(tl.int64), m_ptr.to(tl.int64), 0, 0, 0,
                                   GROUPS * 32 * (4 if G_KIND == 2 else 2) // 128,
                                   GROUPS * 32 * (1 if QUANTIZED else 4) // 128, 0, 0, 0, PREFETCH)
        for j in tl.static_range(1, AHEAD):
            if first + j < whole:
                prefetch_block(line0, step, first + j, LEVEL)
    for j in range(count):
        if PREFETCH != 0:
            if first + j + AHEAD < whole:
                prefetch_block(line0, step, first + j + AHEAD, LEVEL)
        _momentum_block(g_ptr, m_ptr, ms_ptr, u_ptr, table_ptr, first + j, numel, ngroups, cols, gpr, buf_c, nest_c,
                        G_KIND, QUANTIZED, COMPANDED, ALIGNED, BUF_SMALL, NESTEROV, NEST_SMALL, COMPILED, GROUPS)


@triton.jit
def _apply_block(p_ptr, rho_ptr, o_ptr, blk, numel, rows, cols, tiles_per_row, decay_c, alpha_c,
                 P_KIND: tl.constexpr, RHO_KIND: tl.constexpr, RHO_LOG2: tl.constexpr, TRANSPOSED: tl.constexpr,
                 COMPILED: tl.constexpr, GROUPS: tl.constexpr, TILE_COLS: tl.constexpr):
    """Phase 3 on block ``blk``: ``32 * GROUPS`` consecutive values, or with ``TRANSPOSED`` the tile of
    ``32 * GROUPS // TILE_COLS`` rows and ``TILE_COLS`` columns of a ``(rows, cols)`` parameter whose ``O`` is
    the transpose of a contiguous ``(cols, rows)`` matrix (what Newton-Schulz returns for a tall matrix: each
    load is coalesced, and the compiler moves ``O``'s tile into the parameter's layout). Returns which values
    were left unchanged (update not finite), in a tile of that shape."""
    if TRANSPOSED:
        tile_row = blk // tiles_per_row
        r = tile_row * (GROUPS * GROUP // TILE_COLS) + tl.arange(0, GROUPS * GROUP // TILE_COLS)
        c = (blk - tile_row * tiles_per_row) * TILE_COLS + tl.arange(0, TILE_COLS)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        offs = r[:, None] * cols + c[None, :]
        o = bf16_value(tl.load(o_ptr + (c[None, :] * rows + r[:, None]), mask=mask, other=0), COMPILED)
    else:
        offs = (blk * GROUPS + tl.arange(0, GROUPS))[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = offs < numel
        o = bf16_value(tl.load(o_ptr + offs, mask=mask, other=0), COMPILED)
    bad = ((o.to(tl.int32, bitcast=True) & FP32_EXP_MASK) == FP32_EXP_MASK) & mask
    o = tl.where(bad, 0.0, o)
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
    theta = tl.fma(o, alpha_c, theta * decay_c)
    p_out, r, theta = new_param(theta, theta, P_KIND, RHO_KIND, RHO_LOG2, False, COMPILED)
    keep = mask & ~bad
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
    return bad


@triton.jit(do_not_specialize=["wd_bits", "ratio_bits"])
def _apply_kernel(
    p_ptr, rho_ptr, o_ptr, skipped_ptr,  # parameter (bf16 as int16 bits, fp16, fp32); rho; O (bf16 bits); count
    numel, nblocks, decay, alpha,  # elements; blocks; 1 - lr * wd; -adjusted_lr (MuonScalars), unless LR_PTR
    rows, cols, tiles_per_row,  # TRANSPOSED: the parameter's shape, and its tiles of 32 columns per row of tiles
    lr_ptr, wd_bits, ratio_bits,  # LR_PTR: the learning rate in device memory; float64 bits of wd and lr_ratio
    P_KIND: tl.constexpr, RHO_KIND: tl.constexpr, RHO_LOG2: tl.constexpr, COUNT: tl.constexpr,
    LR_PTR: tl.constexpr, COMPILED: tl.constexpr, GROUPS: tl.constexpr,
    TRANSPOSED: tl.constexpr, TILE_COLS: tl.constexpr,  # O is the transpose of a contiguous matrix (_apply_block)
    BLOCKS: tl.constexpr,  # consecutive blocks per program
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,  # as programs.step_blocks'
):
    if LR_PTR:  # MuonScalars.make's float64 arithmetic on the learning rate read now, rounded once to fp32
        lr = tl.load(lr_ptr).to(tl.float64)
        decay_c = (tl.full([], 1.0, tl.float64) - lr * f64(wd_bits)).to(tl.float32)
        alpha_c = (-(lr * f64(ratio_bits))).to(tl.float32)
    else:
        decay_c: tl.float32 = decay  # (annotated: the interpreter keeps a host float as it keeps the arguments)
        alpha_c: tl.float32 = alpha
    first = tl.program_id(0) * BLOCKS
    count = tl.minimum(nblocks - first, BLOCKS)
    if PREFETCH != 0:  # whole blocks only: the update's, the parameter's and rho's lines
        whole = first + tl.minimum(count, numel // (GROUPS * 32) - first)
        line0, step = stream_lines(o_ptr.to(tl.int64), p_ptr.to(tl.int64), rho_ptr.to(tl.int64), 0, 0,
                                   GROUPS * 32 * 2 // 128, GROUPS * 32 * (4 if P_KIND == 2 else 2) // 128,
                                   GROUPS * 32 * RHO_KIND // 128, 0, 0, PREFETCH)
        for j in tl.static_range(1, AHEAD):
            if first + j < whole:
                prefetch_block(line0, step, first + j, LEVEL)
    bad = tl.zeros((GROUPS * GROUP // TILE_COLS, TILE_COLS), tl.int32)
    for j in range(count):
        if PREFETCH != 0:
            if first + j + AHEAD < whole:
                prefetch_block(line0, step, first + j + AHEAD, LEVEL)
        bad += _apply_block(p_ptr, rho_ptr, o_ptr, first + j, numel, rows, cols, tiles_per_row, decay_c, alpha_c,
                            P_KIND, RHO_KIND, RHO_LOG2, TRANSPOSED, COMPILED, GROUPS, TILE_COLS).to(tl.int32)
    if COUNT:  # one relaxed atomic per program, and none where nothing was skipped
        n_bad = tl.sum(tl.sum(bad, axis=1), axis=0)
        tl.atomic_add(skipped_ptr, n_bad, mask=n_bad > 0, sem="relaxed")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 data as its int16 bits (the kernels move bf16 as integers)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _compiled(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def momentum_lines(slots: int, grad_bytes: int, quantized: bool, aligned: bool) -> tuple[int, int] | None:
    """128-byte lines per block of ``slots`` values of the momentum update's streams the prefetch asks for:
    the gradient's and the codes' (or the fp32 buffer's); None (no prefetch) where 8-bit rows end inside a
    group, which makes blocks ragged."""
    if quantized and not aligned:
        return None
    return slots * grad_bytes // 128, slots * (1 if quantized else 4) // 128


def apply_lines(slots: int, param_bytes: int, rho_bytes: int, transposed: bool) -> tuple[int, int, int] | None:
    """The same for the weight update: the update's (bf16), the parameter's and rho's; None for the tiles of
    a transposed update, which are not consecutive bytes."""
    if transposed:
        return None
    return slots * 2 // 128, slots * param_bytes // 128, slots * rho_bytes // 128


def launch_options(launch: KernelLaunch, lines: tuple[int, ...] | None, compiled: bool = True) -> dict:
    """The constexprs and compiler options of a kernel launched as ``launch``; ``lines``: what
    ``momentum_lines`` or ``apply_lines`` give for a block (None: no prefetch). The prefetch runs where both
    ``launch.prefetch`` and ``LaunchConfig.prefetch`` ask for it, in compiled kernels."""
    config = current()
    prefetch = launch.prefetch and config.prefetch and compiled and lines is not None
    options = dict(GROUPS=launch.groups, BLOCKS=launch.blocks, PREFETCH=slots_for(lines) if prefetch else 0,
                   # (without the prefetch these two are read by nothing: fixed, so they compile nothing new)
                   AHEAD=config.prefetch_ahead if prefetch else 1, LEVEL=config.prefetch_level if prefetch else 2,
                   num_warps=launch.warps, enable_fp_fusion=False)
    if launch.max_registers is not None:
        options["maxnreg"] = launch.max_registers
    return options


def muon_momentum(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum_scales: torch.Tensor | None, *,
                  cols: int | None, scalars: MuonScalars, companded: bool,
                  grad_cell: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.muon_momentum_`` in one launch: updates the codes and scales (or the fp32 buffer) in place
    and returns ``U`` as bf16 (the reference's fp32 update rounded to bf16, as ``flash_muon`` sends it).
    ``grad_cell``: an int64 device tensor whose first element is the address the kernel reads the gradient
    from (``grad`` then gives only its dtype and shape): a CUDA graph that captured the launch reads the
    gradient wherever the cell says at each replay."""
    update = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
    numel = grad.numel()
    if numel == 0:
        return update
    quantized = momentum_scales is not None
    if quantized:
        rows = numel // cols
        gpr = (cols + Q.GROUP - 1) // Q.GROUP
        ngroups = rows * gpr
    else:
        gpr = ngroups = 0
        cols = numel
    units = ngroups if quantized else (numel + Q.GROUP - 1) // Q.GROUP
    sc = scalars
    buf_small, nest_small = sc.buffer_weight < 0.5, sc.momentum < 0.5
    codes = momentum_buffer.view(torch.uint8) if quantized and companded else momentum_buffer
    aligned = quantized and cols % Q.GROUP == 0
    launch = current().muon_momentum
    nblocks = triton.cdiv(units, launch.groups)
    grid = (triton.cdiv(nblocks, launch.blocks),)
    options = launch_options(launch, momentum_lines(launch.groups * Q.GROUP, grad.element_size(), quantized, aligned),
                             _compiled(grad))
    _momentum_kernel[grid](
        grad_cell if grad_cell is not None else _bits(grad), codes,
        momentum_scales.view(torch.int16) if quantized else momentum_buffer,
        update.view(torch.int16), Q.exp_avg_table(grad.device), numel, ngroups, cols, gpr, nblocks,
        sc.buffer_weight if buf_small else sc.buffer_weight - 1.0, sc.momentum if nest_small else sc.momentum - 1.0,
        G_KIND=_KINDS[grad.dtype], QUANTIZED=quantized, COMPANDED=companded,
        ALIGNED=aligned, BUF_SMALL=buf_small, NESTEROV=sc.nesterov, NEST_SMALL=nest_small,
        COMPILED=_compiled(grad), G_CELL=grad_cell is not None, **options)
    return update


def muon_apply(param: torch.Tensor, rho: torch.Tensor | None, ortho: torch.Tensor, *, scalars: MuonScalars,
               skipped: torch.Tensor | None, lr: torch.Tensor | None = None, weight_decay: float = 0.0,
               lr_ratio: float = 1.0) -> None:
    """``reference.muon_apply_`` in one launch, in place; ``ortho`` bf16 of the parameter's shape, contiguous
    or (a 2-D parameter) the transpose of a contiguous matrix, as Newton-Schulz returns a tall one; any other
    strides are copied first.

    ``lr``: a one-element tensor on the parameter's device holding the learning rate, read when the kernel
    runs (a capturable step: nothing on the host changes between steps); the kernel then computes
    ``scalars.decay`` and ``scalars.alpha`` from it, ``weight_decay`` and ``lr_ratio`` as
    ``MuonScalars.make`` does on the host (float64, rounded once to fp32): the same bits."""
    numel = param.numel()
    if numel == 0:
        return
    rho_kind, rho_log2 = _RHO[rho.dtype if rho is not None else None]
    rows, cols = ortho.shape if ortho.dim() == 2 else (0, 0)
    # a tall matrix's O is the transpose of Newton-Schulz's contiguous result: read in tiles, not copied first
    transposed = ortho.dim() == 2 and param.dim() == 2 and rows > 1 and ortho.stride() == (1, rows)
    if transposed:
        launch = current().muon_apply_transposed
        tile_cols = launch.tile_cols
        tiles_per_row = triton.cdiv(cols, tile_cols)
        nblocks = triton.cdiv(rows, launch.groups * Q.GROUP // tile_cols) * tiles_per_row
    else:
        launch, tiles_per_row, ortho, tile_cols = current().muon_apply, 0, ortho.contiguous(), Q.GROUP
        nblocks = triton.cdiv(triton.cdiv(numel, Q.GROUP), launch.groups)
    options = launch_options(launch, apply_lines(launch.groups * Q.GROUP, param.element_size(), rho_kind, transposed),
                             _compiled(param))
    _apply_kernel[(triton.cdiv(nblocks, launch.blocks),)](
        _bits(param), rho if rho is not None else param, ortho.view(torch.int16),
        skipped if skipped is not None else param, numel, nblocks, scalars.decay, scalars.alpha, rows, cols,
        tiles_per_row, lr if lr is not None else param, f64_bits(weight_decay), f64_bits(lr_ratio),
        P_KIND=_KINDS[param.dtype], RHO_KIND=rho_kind, RHO_LOG2=rho_log2, COUNT=skipped is not None,
        LR_PTR=lr is not None, COMPILED=_compiled(param), TRANSPOSED=transposed,
        TILE_COLS=tile_cols, **options)
