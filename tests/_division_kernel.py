"""A Triton kernel around ``fused._div_normalized`` alone, for tests/test_gpu.py (imported there when a test
runs, so that collecting the tests imports no triton)."""

import triton
import triton.language as tl

from flashdist.kernels.triton import fused


@triton.jit
def divide_kernel(n_ptr, d_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    n = tl.load(n_ptr + i, mask=inside, other=0.0)
    d = tl.load(d_ptr + i, mask=inside, other=1.0)
    tl.store(out_ptr + i, fused._div_normalized(n, d, True), mask=inside)


def divide(n, d):
    """``_div_normalized(n, d)`` elementwise for fp32 CUDA tensors."""
    out = n.new_empty(n.shape)
    block = 1024
    divide_kernel[(triton.cdiv(n.numel(), block),)](n, d, out, n.numel(), BLOCK=block, **fused.compile_options())
    return out
