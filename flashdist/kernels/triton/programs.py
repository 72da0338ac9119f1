"""The two launch styles of the fused step, and the loop over a program's consecutive blocks they share.

- ``table_kernel``: tensors below ``LaunchConfig.large_numel`` elements share ONE launch over a work table of
  ``(tensor, first block, blocks)`` items of up to ``table_blocks`` consecutive blocks of one tensor; each
  program reads its item, then the tensor's addresses and sizes from an int64 table (a chain of two dependent
  loads, paid once per item; the row layout is ``plans.TABLE_COLUMNS``).
- ``tensor_kernel``: a tensor of ``large_numel`` elements or more gets a launch of its own, with addresses
  and sizes as kernel arguments, each program walking ``large_blocks`` consecutive blocks; with ``GRAD_CELL``
  (capturable steps) the gradient's address is loaded from a device cell instead, so that a CUDA graph that
  captured the launch reads the address written before each replay.
``ALIGN16`` tells the compiler the addresses are 16-byte aligned (``tl.multiple_of``), without which the loads
are not vectorised; a storage that is not (a view into a flat buffer) is launched without the hint. Programs
are one warp by default (``LaunchConfig.num_warps``), so that no barrier makes warps wait for each other.
With ``SCALARS`` (a capturable step) both read the update's scalars from device memory instead of their
arguments, so that a launch captured in a CUDA graph takes each replay's step count and learning rate.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import plans
from .prefetch import prefetch_block, prefetch_lines
from .step import step_block

TABLE_STRIDE = tl.constexpr(plans.TABLE_STRIDE)


@triton.jit
def load_scalars(scalars_ptr):
    """The nine fp32 scalar slots of a capturable step (device_scalars.scalars_kernel wrote them)."""
    return (tl.load(scalars_ptr + 0), tl.load(scalars_ptr + 1), tl.load(scalars_ptr + 2), tl.load(scalars_ptr + 3),
            tl.load(scalars_ptr + 4), tl.load(scalars_ptr + 5), tl.load(scalars_ptr + 6), tl.load(scalars_ptr + 7),
            tl.load(scalars_ptr + 8))


@triton.jit
def step_blocks(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr,
    first, count,  # blocks first .. first + count - 1 of the tensor
    numel, ngroups, cols, gpr,
    sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr,  # 0, or slots (a power of two >= the lines of a block) of the next block's L2 prefetch
    AHEAD: tl.constexpr,  # the prefetch asks for block j + AHEAD while block j is computed
    LEVEL: tl.constexpr,  # the cache level the prefetch fills (LaunchConfig.prefetch_level)
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
        line0, step = prefetch_lines(p_addr, g_addr, m_addr, v_addr, rho_addr, P_KIND, G_KIND, RHO_KIND,
                                      QUANTIZED, ALGO, HAS_M, GROUPS, PREFETCH)
        for j in tl.static_range(1, AHEAD):  # the blocks before the first one the loop asks for
            if first + j < whole:
                prefetch_block(line0, step, first + j, LEVEL)
    for j in range(count):
        if PREFETCH != 0 and (ALIGNED or not QUANTIZED):
            if first + j + AHEAD < whole:
                prefetch_block(line0, step, first + j + AHEAD, LEVEL)
        bad += step_block(
            p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, first + j,
            numel, ngroups, cols, gpr,
            sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
            P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, ALGO,
            HAS_M, NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS,
        )
    if COUNT_SKIPPED:
        n_bad = tl.sum(bad)
        tl.atomic_add(skipped_ptr, n_bad, mask=n_bad > 0, sem="relaxed")


@triton.jit
def table_kernel(
    work_ptr,  # int32 (items, 3): (tensor index, first block, number of blocks) of each program
    tensors_ptr,  # int64 (tensors, TABLE_STRIDE): addresses of p, g, m, v, ms, vs, rho; numel, ngroups, cols, gpr
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    scalars_ptr,  # fp32 (9,) scalar slots on the device when SCALARS (device_scalars), else unused
    sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,
    SCALARS: tl.constexpr,  # the scalars are read from scalars_ptr (a capturable step), not the sc arguments
):
    if SCALARS:
        sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8 = load_scalars(scalars_ptr)
    item = tl.program_id(0)
    t = tl.load(work_ptr + 3 * item)
    first = tl.load(work_ptr + 3 * item + 1)
    count = tl.load(work_ptr + 3 * item + 2)
    row = tensors_ptr + t.to(tl.int64) * TABLE_STRIDE
    p_addr, g_addr, m_addr, v_addr = tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    ms_addr, vs_addr, rho_addr = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    # table tensors have fewer than LARGE_NUMEL (< 2^31) elements: int32 index arithmetic
    numel, ngroups = tl.load(row + 7).to(tl.int32), tl.load(row + 8).to(tl.int32)
    cols, gpr = tl.load(row + 9).to(tl.int32), tl.load(row + 10).to(tl.int32)
    # several consecutive blocks of one tensor per program: the chain of dependent loads above (work item,
    # then the tensor's row) is paid once for all of them
    step_blocks(
        p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr, first, count,
        numel, ngroups, cols, gpr,
        sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, ALGO,
        HAS_M, NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS, PREFETCH, AHEAD, LEVEL,
    )


@triton.jit
def tensor_kernel(
    p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr,  # int addresses of one tensor's data (0: none)
    table_ptr,  # fp32 codes.EXP_AVG_TABLE on this device
    skipped_ptr,  # int32 skip counter (any int32 tensor when COUNT_SKIPPED is False)
    scalars_ptr,  # fp32 (9,) scalar slots on the device when SCALARS, else unused
    numel, ngroups, cols, gpr,  # elements; groups (quantized); row length; groups per row
    nblocks,  # blocks of GROUPS groups in the tensor
    sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, RHO_KIND: tl.constexpr, QUANTIZED: tl.constexpr,
    ALIGNED: tl.constexpr, ALIGN16: tl.constexpr, COMPANDED: tl.constexpr, DECOUPLED: tl.constexpr,
    COUNT_SKIPPED: tl.constexpr, ALGO: tl.constexpr, HAS_M: tl.constexpr, NESTEROV: tl.constexpr,
    EXACT: tl.constexpr, COMPILED: tl.constexpr, FAST_UPDATE: tl.constexpr, RHO_LOG2: tl.constexpr,
    GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, LEVEL: tl.constexpr,
    BLOCKS: tl.constexpr,  # consecutive blocks per program
    WIDE: tl.constexpr,  # numel >= 2^31: int64 index arithmetic
    SCALARS: tl.constexpr,  # the scalars are read from scalars_ptr (a capturable step), not the sc arguments
    GRAD_CELL: tl.constexpr = False,  # g_addr points at an int64 cell holding the gradient's address
):
    if SCALARS:
        sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8 = load_scalars(scalars_ptr)
    if GRAD_CELL:  # (a capturable launch: the address is written before each replay, plans.Plan.retarget)
        g_addr = tl.load(g_addr)
    first = tl.program_id(0)
    if WIDE:
        first = first.to(tl.int64)
    first = first * BLOCKS
    count = tl.minimum(nblocks - first, BLOCKS)
    step_blocks(
        p_addr, g_addr, m_addr, v_addr, ms_addr, vs_addr, rho_addr, table_ptr, skipped_ptr, first, count,
        numel, ngroups, cols, gpr,
        sc0, sc1, sc2, sc3, sc4, sc5, sc6, sc7, sc8,
        P_KIND, G_KIND, RHO_KIND, QUANTIZED, ALIGNED, ALIGN16, COMPANDED, DECOUPLED, COUNT_SKIPPED, ALGO, HAS_M,
        NESTEROV, EXACT, COMPILED, FAST_UPDATE, RHO_LOG2, GROUPS, PREFETCH, AHEAD, LEVEL,
    )

