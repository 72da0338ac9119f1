"""flashdist.quant.moment.QuantizedMoment: the one type for a moment kept as 8-bit codes and group scales."""

import pytest
import torch

from flashdist import FlashAdamW, FlashSGD
from flashdist.quant import codes as Q
from flashdist.quant.moment import CODES, SCALES, MomentLayout, QuantizedMoment, state_layout

MOMENTS = ["exp_avg", "exp_avg_sq", "momentum_buffer"]


def _values(name, shape, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3.0
    return x * x if name == "exp_avg_sq" else x  # a second moment is non-negative


def test_state_keys_round_trip():
    for name in MOMENTS:
        codes_key, scales_key = QuantizedMoment.keys(name)
        assert (codes_key, scales_key) == (QuantizedMoment.codes_key(name), QuantizedMoment.scales_key(name))
        assert QuantizedMoment.split_key(codes_key) == (name, CODES)
        assert QuantizedMoment.split_key(scales_key) == (name, SCALES)
        assert QuantizedMoment.split_key(name) == (name, None)
    for other in ("step", "rho", "exp_avg_sq"):
        assert QuantizedMoment.split_key(other) == (other, None)
    assert QuantizedMoment.any_codes(["step", QuantizedMoment.codes_key("exp_avg")])
    assert not QuantizedMoment.any_codes(["step", "exp_avg", QuantizedMoment.scales_key("exp_avg")])


def test_layout_from_the_global_shape():
    assert MomentLayout.of((10,)) is None and MomentLayout.of(()) is None  # fp32 moments
    row = MomentLayout.of((6, 5, 13))
    assert (row.rows, row.cols, row.groups_per_row, row.flat) == (6, 65, 3, False)
    flat = MomentLayout.of((6, 5, 13), flat=True)
    assert (flat.rows, flat.cols, flat.groups_per_row, flat.flat) == (1, 390, 13, True)
    assert MomentLayout.of((77,), flat=True).groups_per_row == 3  # 1-d partitions are quantized when flat
    # a dim-0 shard of 2 of the 6 rows holds 2 rows of scales; a flat partition one row
    assert row.local_scales_shape((2, 5, 13)) == (2, 3)
    assert flat.local_scales_shape((390,)) == (1, 13)
    assert state_layout((6, 5, 13)) == (6, 65, 3) and state_layout((10,)) is None


@pytest.mark.parametrize("companded", [True, False], ids=["companded", "linear"])
@pytest.mark.parametrize("name", MOMENTS)
def test_quantize_and_dequantize_by_kind(name, companded):
    """Signed moments get int8 codes; the second moment uint8 codes of sqrt(v) (companded) or of v (linear)."""
    values = _values(name, (5, 70))
    layout = MomentLayout.of(values.shape)
    moment = QuantizedMoment.quantize(name, values, layout, companded)
    assert moment.codes.shape == values.shape and moment.scales.shape == (5, 3)
    want = torch.uint8 if name == "exp_avg_sq" else torch.int8
    assert moment.codes.dtype == QuantizedMoment.code_dtype(name) == want
    assert moment.scales.dtype == torch.bfloat16
    if name == "exp_avg_sq":
        stored = Q.sqrt_rn(values) if companded else values  # what the scales are the group absmax of
        expected = Q.to_bf16_value(Q.group_absmax(Q.grouped(stored, 70))).squeeze(-1)
        assert torch.equal(moment.scales.float(), expected)
        assert torch.equal(moment.dequantize(), Q.dequantize_exp_avg_sq(moment.codes, moment.scales, 70, companded))
    else:
        assert (moment.codes.min() < 0) and (moment.codes.max() > 0)
        assert torch.equal(moment.dequantize(), Q.dequantize_exp_avg(moment.codes, moment.scales, 70, companded))
    # idempotent: quantizing the dequantized values gives back the same codes and scales
    again = QuantizedMoment.quantize(name, moment.dequantize(), layout, companded)
    assert torch.equal(again.codes, moment.codes) and torch.equal(again.scales, moment.scales)
    torch.testing.assert_close(moment.dequantize(), values, rtol=0.05, atol=0.05 * float(values.abs().max()))


def test_rows_quantize_as_in_the_whole():
    values = _values("exp_avg", (7, 40))
    layout = MomentLayout.of(values.shape)
    whole = QuantizedMoment.quantize("exp_avg", values, layout, True)
    parts = [QuantizedMoment.quantize("exp_avg", values[s], layout, True) for s in (slice(0, 3), slice(3, 7))]
    joined = QuantizedMoment.cat(parts)
    assert torch.equal(joined.codes, whole.codes) and torch.equal(joined.scales, whole.scales)
    assert joined.layout == layout
    piece = whole.row_slice(slice(3, 7))
    assert piece.layout.rows == 4 and torch.equal(piece.dequantize(), whole.dequantize()[3:7])


def test_zeros_store_and_from_state_share_tensors():
    p = torch.zeros(4, 50, dtype=torch.bfloat16)
    layout = MomentLayout.of(p.shape)
    moment = QuantizedMoment.zeros("exp_avg_sq", p, layout, True)
    assert moment.codes.shape == p.shape and moment.codes.dtype == torch.uint8
    assert moment.scales.shape == (4, 2) and not moment.scales.any()
    state = {"step": torch.tensor(0.0)}
    moment.store(state)
    assert QuantizedMoment.held_in(state, "exp_avg_sq") and not QuantizedMoment.held_in(state, "exp_avg")
    read = QuantizedMoment.from_state(state, "exp_avg_sq", flat=False, companded=True)
    assert read.codes is moment.codes and read.scales is moment.scales and read.layout == layout
    values = _values("exp_avg_sq", p.shape)
    read.quantize_(values)  # writes into the state's own tensors
    expected = QuantizedMoment.quantize("exp_avg_sq", values, layout, True)
    assert torch.equal(state[QuantizedMoment.codes_key("exp_avg_sq")], expected.codes)
    assert torch.equal(state[QuantizedMoment.scales_key("exp_avg_sq")], expected.scales)
    popped = QuantizedMoment.from_state(state, "exp_avg_sq", flat=False, companded=True, pop=True)
    assert list(state) == ["step"] and popped.codes is moment.codes


@pytest.mark.parametrize("make", [lambda ps: FlashAdamW(ps, lr=1e-2), lambda ps: FlashSGD(ps, lr=1e-2, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_optimizer_state_is_the_type(make):
    """The optimizer's state holds each moment as the type lays it out, and its compressed state dict is the
    type's quantization of its portable one."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(6, 40, dtype=torch.bfloat16))]
    opt = make(ps)
    ps[0].grad = torch.randn_like(ps[0])
    opt.step()
    group = opt.param_groups[0]
    portable = opt.state_dict()["state"][0]
    opt.state_dict_format = "compressed"
    compressed = opt.state_dict()["state"][0]
    for name in opt.moments_of(group):
        live = QuantizedMoment.from_state(opt.state[ps[0]], name, flat=False, companded=True)
        assert live.layout == MomentLayout.of(ps[0].shape)
        again = QuantizedMoment.quantize(name, portable[name], live.layout, True)
        assert torch.equal(compressed[QuantizedMoment.codes_key(name)], again.codes)
        assert torch.equal(compressed[QuantizedMoment.scales_key(name)], again.scales)
        assert torch.equal(portable[name], live.dequantize())
