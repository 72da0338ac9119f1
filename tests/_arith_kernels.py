"""Triton kernels around ``bits.div_normalized`` and ``bits.sqrt_rn`` alone, for tests/test_gpu.py
(imported there when a test runs, so that collecting the tests imports no triton)."""

import triton
import triton.language as tl

from flashdist.kernels.triton import DEFAULT, bits

# the compiler options of the optimizer's exact launches (one warp, no FMA contraction)
OPTIONS = DEFAULT.replace(exact=True).compile_options()


@triton.jit
def divide_kernel(n_ptr, d_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    n = tl.load(n_ptr + i, mask=inside, other=0.0)
    d = tl.load(d_ptr + i, mask=inside, other=1.0)
    tl.store(out_ptr + i, bits.div_normalized(n, d, True), mask=inside)


def divide(n, d):
    """``div_normalized(n, d)`` elementwise for fp32 CUDA tensors."""
    out = n.new_empty(n.shape)
    block = 1024
    divide_kernel[(triton.cdiv(n.numel(), block),)](n, d, out, n.numel(), BLOCK=block, **OPTIONS)
    return out


@triton.jit
def sqrt_kernel(v_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    v = tl.load(v_ptr + i, mask=inside, other=1.0)
    tl.store(out_ptr + i, bits.sqrt_rn(v, True), mask=inside)


def sqrt(v, block=256):
    """``sqrt_rn(v)`` elementwise for an fp32 CUDA tensor, in programs of ``block`` values (one warp each,
    as the optimizer's): each block takes the fast path or, when it holds a value outside its range, the
    per-value one."""
    out = v.new_empty(v.shape)
    sqrt_kernel[(triton.cdiv(v.numel(), block),)](v, out, v.numel(), BLOCK=block, **OPTIONS)
    return out
