"""The L2 prefetch of a program's next block: while a program computes one block it asks the cache for the
next one's bytes, so that the next block's loads find them in L2 instead of waiting for DRAM.

One ``prefetch.global.L2`` per 128-byte line of the block's param, grad, rho and moment bytes: a hint that
occupies no register and that nothing waits for. Whole blocks only, so that every line asked for holds bytes
of the tensor. The lines' addresses are computed once per program and moved by one multiply-add per block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...quant import codes as Q
from .bits import ADAM, ADAM_ALGO, INTERPRETED
from .config import LaunchConfig



@triton.jit
def prefetch_lines(p_addr, g_addr, m_addr, v_addr, rho_addr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
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
    V_LINES: tl.constexpr = M_LINES if ALGO == ADAM_ALGO else 0
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
def prefetch_block(line0, step, blk, LEVEL: tl.constexpr):
    """Ask the cache (L2, or L1 with ``LEVEL`` 1) for block ``blk``'s lines (``prefetch_lines``), so that a
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



def prefetch_slots(flags: dict, groups: int, config: LaunchConfig) -> int:
    """The kernel's PREFETCH for a launch with constexpr ``flags`` and ``groups`` groups per block: 0 (none)
    or a power of two at least the 128-byte lines of one block's per-value streams (``prefetch_block``)."""
    if not config.prefetch or INTERPRETED or (flags["QUANTIZED"] and not flags["ALIGNED"]):
        return 0  # the interpreter has no inline assembly; unaligned rows make blocks ragged
    slots = groups * Q.GROUP
    float_bytes = {0: 2, 1: 2, 2: 4}
    moment_bytes = 1 if flags["QUANTIZED"] else 4
    moments = (2 if flags["ALGO"] == ADAM else 1) if flags["HAS_M"] else 0
    lines = sum(slots * b // 128 for b in (float_bytes[flags["P_KIND"]], float_bytes[flags["G_KIND"]],
                                             flags["RHO_KIND"], *[moment_bytes] * moments))
    return 1 << max(lines - 1, 0).bit_length() if lines else 0
