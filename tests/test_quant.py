"""Round-trip error bounds of the moment codes and of rho (eager definitions in flashdist.quant)."""

import math

import pytest
import torch

from flashdist.quant import codes as Q
from flashdist.quant import rho as R

SHAPES = [(1, 1), (3, 31), (2, 33), (4, 64), (5, 97)]


def _moments(shape, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-spread, 0, shape[-1])[torch.randperm(shape[-1], generator=g)]
    return x


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("companded", [True, False], ids=["companded", "linear"])
def test_exp_avg_round_trip_bound(shape, companded):
    m = _moments(shape)
    cols = shape[1]
    codes, scales = Q.quantize_exp_avg(m, cols, companded)
    assert codes.dtype == torch.int8 and codes.shape == m.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == (shape[0], (cols + 31) // 32)
    back = Q.dequantize_exp_avg(codes, scales, cols, companded)
    s = scales.float().repeat_interleave(32, dim=1)[:, :cols]
    # Linear: half a code step of the (bf16-rounded) scale. Companded: the inverse map x = y / (2 - |y|) has
    # slope at most 2, so half a code step becomes at most one step (1/127) of the scale; plus bf16
    # rounding of the scale itself (2^-8 relative).
    step = 1.0 / 127 if companded else 0.5 / 127
    bound = s * (step + 2.0**-8) + 1e-30
    assert ((back - m).abs() <= bound).all()
    # the group maximum is reproduced to within the scale's rounding
    assert torch.allclose(back.abs().amax(), m.abs().amax(), rtol=2.0**-7)


def test_companding_is_finer_near_zero():
    m = _moments((8, 64), spread=3.0)
    err = {c: (Q.dequantize_exp_avg(*Q.quantize_exp_avg(m, 64, c), 64, c) - m).abs() for c in (True, False)}
    small = m.abs() < m.abs().amax(dim=1, keepdim=True) / 20
    assert err[True][small].mean() < err[False][small].mean()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("companded", [True, False], ids=["sqrt", "linear"])
def test_exp_avg_sq_round_trip_bound(shape, companded):
    v = _moments(shape).square()
    cols = shape[1]
    codes, scales = Q.quantize_exp_avg_sq(v, cols, companded)
    assert codes.dtype == torch.uint8 and codes.shape == v.shape
    back = Q.dequantize_exp_avg_sq(codes, scales, cols, companded)
    s = scales.float().repeat_interleave(32, dim=1)[:, :cols]
    if companded:  # sqrt(v) is within half a step of 1/255 of the scale (plus scale rounding)
        err = (back.sqrt() - v.sqrt()).abs()
    else:
        err = (back - v).abs()
    assert (err <= s * (0.5 / 255 + 2.0**-8) + 1e-30).all()
    assert (back >= 0).all()


def test_scales_keep_tiny_and_huge_moments():
    """bf16 scales keep the moments of 1e-10 and 1e4 gradients (fp16 scales flush 1e-20 to zero and
    overflow above 65504)."""
    for g in (1e-10, 1e4):
        m = torch.full((2, 64), g)
        v = m.square()
        back_m = Q.dequantize_exp_avg(*Q.quantize_exp_avg(m, 64, True), 64, True)
        back_v = Q.dequantize_exp_avg_sq(*Q.quantize_exp_avg_sq(v, 64, True), 64, True)
        assert torch.allclose(back_m, m, rtol=2.0**-7)
        assert torch.allclose(back_v, v, rtol=2.0**-6)
        assert (back_v > 0).all() and torch.isfinite(back_v).all()


def test_zero_group_and_empty():
    codes, scales = Q.quantize_exp_avg(torch.zeros(3, 40), 40, True)
    assert (codes == 0).all() and (scales == 0).all()
    assert (Q.dequantize_exp_avg(codes, scales, 40, True) == 0).all()
    codes, scales = Q.quantize_exp_avg(torch.zeros(0, 40), 40, True)
    assert codes.shape == (0, 40) and scales.shape == (0, 2)


def test_layout_depends_on_global_shape_only():
    assert Q.quantized_layout((10,)) is None
    assert Q.quantized_layout(()) is None
    assert Q.quantized_layout((7, 3, 5)) == (7, 15, 1)
    assert Q.quantized_layout((3, 65)) == (3, 65, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [24, 32])
def test_rho_reconstruction_bound(dtype, bits):
    g = torch.Generator().manual_seed(1)
    decades = (-30, 30) if dtype == torch.bfloat16 else (-4, 4)  # the format's normal range
    sign = torch.randint(0, 2, (50_000,), generator=g) * 2.0 - 1.0
    theta = sign * (1 + torch.rand(50_000, generator=g)) * torch.logspace(*decades, 50_000)
    low, rho = R.split(theta, dtype, R.rho_dtype(bits))
    assert low.dtype == dtype and rho.dtype == R.rho_dtype(bits)
    back = R.merge(low, rho)
    rel = ((back - theta).abs() / theta.abs()).max().item()
    significand = 8 if dtype == torch.bfloat16 else 11
    rho_bits = 8 if bits == 24 else 16
    # half a rho step, h / 2^rho_bits, with h <= 2^-significand |theta|; 32-bit adds one fp32 rounding
    bound = 2.0 ** -(significand + rho_bits) + (2.0**-24 if bits == 32 else 0.0)
    assert rel <= bound, (rel, bound)
    if dtype == torch.bfloat16 and bits == 24:
        assert rel <= 2.0**-16
    # the parameter is a nearest or next-nearest neighbour: at most one ulp from theta
    assert ((low.float() - theta).abs() <= 2 * R.half_ulp(low.float(), dtype)).all()
    plain = ((low.float() - theta).abs() / theta.abs()).max().item()
    assert rel < plain / 50


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_of_merge_is_identity_for_24_bit(dtype):
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(100_000, generator=g) * torch.logspace(-3, 3, 100_000)
    low, rho = R.split(theta, dtype, torch.int8)
    low2, rho2 = R.split(R.merge(low, rho), dtype, torch.int8)
    assert torch.equal(low.view(torch.int16), low2.view(torch.int16)) and torch.equal(rho, rho2)
    # every code is used, the extra negative one included
    assert rho.min() == -128 and rho.max() == 127


def test_rho_at_binade_edges_and_subnormals():
    x = torch.tensor([1.0 - 2**-12, 1.0 + 2**-12, 1.0 - 2**-9 - 2**-20, 2.0**-126 * 1.5, 3e-40, -2.0**-130, 0.0,
                      1e38, -(1.0 + 2**-8 - 2**-20)])
    low, rho = R.split(x, torch.bfloat16, torch.int8)
    back = R.merge(low, rho)
    assert torch.isfinite(back).all()
    assert ((back - x).abs() <= R.half_ulp(low.float(), torch.bfloat16) / 256).all()


def test_rho_overflowed_param_gets_zero():
    low, rho = R.split(torch.tensor([1e39, -1e39, 70000.0]), torch.float16, torch.int8)
    assert rho.tolist() == [0, 0, 0]


def test_sqrt_rn_is_correctly_rounded():
    """codes.sqrt_rn against numpy's IEEE square root, on random fp32 bit patterns of every magnitude (torch's
    own CPU sqrt is not correctly rounded in some builds)."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 0x7F800000, (1_000_000,), generator=g, dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), 1e-45, 2.0**-149, 3.4e38, 4.0, 2.0])])
    got = Q.sqrt_rn(x).numpy().view(np.int32)
    want = np.sqrt(x.numpy()).view(np.int32)
    assert (got == want).all()


def test_exp_avg_table_is_the_companded_inverse():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    y = codes.float() * Q.INV127  # fp32 product and difference, then the correctly rounded quotient
    want = (y.double() / (2.0 - y.abs()).double()).float()
    assert torch.equal(Q.EXP_AVG_TABLE, want)
    assert Q.EXP_AVG_TABLE[127] == 1.0 and Q.EXP_AVG_TABLE[0] == 0.0


@pytest.mark.parametrize("companded", [True, False], ids=["companded", "linear"])
def test_subnormal_moments_keep_their_codes(companded):
    """Groups whose absmax is subnormal (the reciprocal 127 / A or 255 / A would overflow fp32) are lifted by
    2^64: their codes still reach the end of the range and re-quantize to themselves."""
    m = torch.tensor([[1e-40, -3e-41, 2e-44, 0.0] * 8])
    codes, scales = Q.quantize_exp_avg(m, 32, companded)
    assert codes.abs().max() == 127
    back = Q.dequantize_exp_avg(codes, scales, 32, companded)
    assert torch.equal(Q.quantize_exp_avg(back, 32, companded)[0], codes)
    v = m.abs()  # subnormal second moments (companded: their roots are ~1e-20, below the lift threshold)
    codes, scales = Q.quantize_exp_avg_sq(v, 32, companded)
    assert codes.max() == 255
    back = Q.dequantize_exp_avg_sq(codes, scales, 32, companded)
    assert torch.equal(Q.quantize_exp_avg_sq(back, 32, companded)[0], codes)


def test_huge_first_moments_keep_their_codes():
    """Groups whose absmax is near fp32's largest value: the companding works on m and A scaled into [1, 2), so
    ``254 m`` does not overflow (unscaled it would, from A above about 1.3e36) and the end codes are reached."""
    m = torch.tensor([[3e38, -1e37, 2e36, 0.0] * 8, [1e37, -2e36, 5e35, 1.0] * 8])
    codes, scales = Q.quantize_exp_avg(m, 32, True)
    assert codes[:, 0].tolist() == [127, 127] and codes[0, 1] < 0
    back = Q.dequantize_exp_avg(codes, scales, 32, True)
    assert torch.isfinite(back).all()
    assert torch.equal(Q.quantize_exp_avg(back, 32, True)[0], codes)


def test_pow2_normalizer():
    """``a * s`` lies in [1, 2) for every ``a`` from 2^-119 up to 2^127, in [2, 4) above; ``s`` is a
    power of two and ``254 s`` is finite for every ``a``, subnormal ones included."""
    a = torch.cat([torch.tensor([1e-45, 1e-40, 2.0**-126, 2.0**-120, 2.0**-119, 1.0, 1.5, 2.0**126, 2.0**127,
                                 3.4e38]), torch.exp2(torch.linspace(-119, 126.9, 1001))])
    s = Q.pow2_normalizer(a)
    assert ((s.view(torch.int32) & 0x7FFFFF) == 0).all() and torch.isfinite(254.0 * s).all()
    scaled = a * s
    normal = (a >= 2.0**-119) & (a < 2.0**127)
    assert ((scaled[normal] >= 1) & (scaled[normal] < 2)).all()
    assert ((scaled[a >= 2.0**127] >= 2) & (scaled[a >= 2.0**127] < 4)).all()
    assert ((scaled[a < 2.0**-119] >= 2.0**-30) & (scaled[a < 2.0**-119] < 1)).all()


def test_step_scalars_are_memoised_by_their_bits():
    """The per-step scalars are computed once per distinct set of arguments (gradient release asks for them
    once per FSDP group): equal arguments give the same object, arguments that differ in any bit (a signed
    zero, the step) give their own values, and non-Python numbers bypass the cache."""
    from flashdist.kernels.scalars import AdamScalars, LionScalars, SGDScalars

    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3, decoupled=True)
    first = AdamScalars.make(**args)
    assert AdamScalars.make(**args) is first
    assert AdamScalars.make(**dict(args, step=4)).step_size != first.step_size
    signed = AdamScalars.make(**dict(args, lr=-0.0))
    assert math.copysign(1.0, signed.step_size) == -1.0
    assert math.copysign(1.0, AdamScalars.make(**dict(args, lr=0.0)).step_size) == 1.0
    tensor_lr = AdamScalars.make(**dict(args, lr=torch.tensor(1e-3, dtype=torch.float64)))
    assert float(tensor_lr.step_size) == first.step_size
    sgd = dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, step=1, decoupled=False)
    assert SGDScalars.make(**sgd) is SGDScalars.make(**sgd)
    assert LionScalars.make(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1) == LionScalars.make(
        lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)


def _next_up(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float32)
    return torch.nextafter(t, torch.tensor([float("inf")])).item()


def test_scale_limits_are_the_largest_that_dequantize_finite():
    """codes.scale_fits' limits: the largest group absmaxes whose bf16 scale the next step dequantizes to
    finite values with any factor up to 1 (the betas; the end codes 127 / 255 included); one fp32 step
    above either, the scale (or its square) is infinite."""
    for limit, is_sqrt in ((Q.SCALE_MAX, False), (Q.SQRT_SCALE_MAX, True)):
        a = torch.tensor([[limit, _next_up(limit)]])
        assert Q.scale_fits(a, is_sqrt).tolist() == [[True, False]]
        assert not Q.scale_fits(torch.tensor([[float("nan")]]), is_sqrt).any()
        scales = a.to(torch.bfloat16)
        if is_sqrt:
            assert torch.isfinite(scales[0, 0].float() ** 2) and torch.isinf(scales[0, 1].float() ** 2)
            v = Q.dequantize_exp_avg_sq(torch.full((1, 32), 255, dtype=torch.uint8), scales[:, :1], 32, True, 1.0)
            assert torch.isfinite(v).all()
        else:
            assert torch.isfinite(scales[0, 0].float()) and torch.isinf(scales[0, 1].float())
            for companded in (True, False):
                m = Q.dequantize_exp_avg(torch.full((1, 32), 127, dtype=torch.int8), scales[:, :1], 32, companded, 1.0)
                assert torch.isfinite(m).all()
            v = Q.dequantize_exp_avg_sq(torch.full((1, 32), 255, dtype=torch.uint8), scales[:, :1], 32, False, 1.0)
            assert torch.isfinite(v).all()
