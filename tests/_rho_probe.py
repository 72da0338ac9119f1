"""A kernel that runs ``rho_bits``' merge and split alone over a block of values, for the every-value tests:
interpreted in tests/test_triton_kernel.py (``COMPILED`` False), compiled with the inline PTX in
tests/test_gpu.py (imported there when its test runs, so that collecting the tests imports no triton)."""

import triton
import triton.language as tl

from flashdist.kernels.triton import rho_bits


@triton.jit
def rho_probe(p_ptr, rho_ptr, theta_ptr, merged_ptr, low_ptr, split_rho_ptr, FP16: tl.constexpr,
              RHO_LOG2: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    """merged = merge(p, rho) (fp32); low, split_rho = split(theta) (the parameter's bits, rho as int32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rho = tl.load(rho_ptr + offs)
    theta = tl.load(theta_ptr + offs)
    if FP16:
        rho = rho.to(tl.int32)
        tl.store(merged_ptr + offs, rho_bits.merge_fp16(tl.load(p_ptr + offs).to(tl.float32), rho, RHO_LOG2))
        low, r = rho_bits.split_fp16(theta, RHO_LOG2)
        tl.store(low_ptr + offs, low.to(tl.float16).to(tl.int16, bitcast=True))
    else:
        tl.store(merged_ptr + offs, rho_bits.merge_bf16(tl.load(p_ptr + offs), rho, RHO_LOG2, COMPILED))
        w, y, _ = rho_bits.split_bf16(theta, theta, RHO_LOG2, False, COMPILED)
        tl.store(low_ptr + offs, (w >> 16).to(tl.int16))
        if RHO_LOG2 == 7:
            r = y.to(tl.int32)
        else:
            r = y.to(tl.int16).to(tl.int32)
    tl.store(split_rho_ptr + offs, r)
