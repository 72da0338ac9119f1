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
    """The fused step's prefetch lines (``stream_lines``): param, grad, rho and moment streams."""
    SLOTS: tl.constexpr = GROUPS * 32
    M_LINES: tl.constexpr = (SLOTS * (1 if QUANTIZED else 4) // 128) if HAS_M else 0
    return stream_lines(p_addr, g_addr, rho_addr, m_addr, v_addr,
                        SLOTS * (4 if P_KIND == 2 else 2) // 128, SLOTS * (4 if G_KIND == 2 else 2) // 128,
                        SLOTS * RHO_KIND // 128, M_LINES, M_LINES if ALGO == ADAM_ALGO else 0, PREFETCH)


@triton.jit
def stream_lines(a0, a1, a2, a3, a4, L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr,
                 L4: tl.constexpr, PREFETCH: tl.constexpr):
    """The prefetch's lines, computed once per program: one 128-byte line per slot of a ``PREFETCH``-slot
    vector, the lines of up to five per-value streams (addresses ``a0`` .. ``a4``, ``L0`` .. ``L4`` lines
    per block, 0 for a stream left out) of block 0 one stream after the other, and each slot's stream's bytes
    per block. Block ``blk``'s line of a slot is ``line0 + blk * step``: a block of a stream is a whole number
    of lines (a power of two of at least 128 bytes; a stream whose block is smaller gets no slot), so
    rounding its address down to a line commutes with moving it by blocks. A stream that does not start on a
    line boundary leaves its last partial line of a block to the loads. Returns (line0, step): int64 line
    addresses and int32 bytes per block, both 0 in a slot that holds no line."""
    k = tl.arange(0, PREFETCH)
    zero = tl.zeros((PREFETCH,), tl.int64)
    # each slot's stream: its address, its lines per block, and the slots of the streams before it
    addr = tl.where(k < L0, zero + a0, zero + a1)
    lines = tl.where(k < L0, L0, L1)
    before = tl.where(k < L0, 0, L0)
    addr = tl.where(k < L0 + L1, addr, zero + a2)
    lines = tl.where(k < L0 + L1, lines, L2)
    before = tl.where(k < L0 + L1, before, L0 + L1)
    addr = tl.where(k < L0 + L1 + L2, addr, zero + a3)
    lines = tl.where(k < L0 + L1 + L2, lines, L3)
    before = tl.where(k < L0 + L1 + L2, before, L0 + L1 + L2)
    addr = tl.where(k < L0 + L1 + L2 + L3, addr, zero + a4)
    lines = tl.where(k < L0 + L1 + L2 + L3, lines, L4)
    before = tl.where(k < L0 + L1 + L2 + L3, before, L0 + L1 + L2 + L3)
    live = k < L0 + L1 + L2 + L3 + L4
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
    return slots_for(slots * b // 128 for b in (float_bytes[flags["P_KIND"]], float_bytes[flags["G_KIND"]],
                                                  flags["RHO_KIND"], *[moment_bytes] * moments))


def slots_for(lines) -> int:
    """``PREFETCH`` for streams of these lines per block (those below one line get none): the power of two
    at least their sum, 0 for none."""
    total = sum(n for n in lines if n >= 1)
    return 1 << max(total - 1, 0).bit_length() if total else 0
