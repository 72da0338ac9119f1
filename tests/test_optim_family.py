"""FlashSGD, FlashSGDW and FlashLion against float64 references (torch.optim.SGD; a float64 SGDW and Lion),
their behaviour as torch optimizers, state dicts and bad input.

Tolerances are per step, in units of ``lr * s`` where ``s`` is the gradient scale of the row (the update of
SGD is ``lr`` times a momentum buffer of the gradients' size; Lion moves every coordinate by ``lr``).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import flashdist
from flashdist import FlashLion, FlashSGD, FlashSGDW

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHAPE, STEPS, LR = (16, 96), 20, 1e-2


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    scale = torch.logspace(-3, 1, SHAPE[0], dtype=torch.float64)[:, None]
    grads = [torch.randn(SHAPE, generator=g, dtype=torch.float64) * scale for _ in range(STEPS)]
    return w0, grads, scale


class Lion64:
    """Lion in float64, as published (decoupled weight decay, sign of the interpolation)."""

    def __init__(self, p, lr, betas, weight_decay):
        self.p, self.lr, self.betas, self.wd = p, lr, betas, weight_decay
        self.m = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        self.p.mul_(1 - self.lr * self.wd)
        self.p.add_(torch.sign(self.m * b1 + self.p.grad * (1 - b1)), alpha=-self.lr)
        self.m.mul_(b2).add_(self.p.grad, alpha=1 - b2)


class SGDW64:
    """torch.optim.SGD without weight decay, after a decoupled decay of the weights (FlashSGDW's order)."""

    def __init__(self, p, lr, weight_decay, **kwargs):
        self.p, self.factor = p, 1 - lr * weight_decay
        self.sgd = torch.optim.SGD([p], lr=lr, weight_decay=0.0, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self):
        self.p.mul_(self.factor)
        self.sgd.step()


VARIANTS = {
    # id: (flash class, float64 reference factory, kwargs); wd small for L2 (see test_optim's note)
    "sgd-momentum": (FlashSGD, lambda p, **kw: torch.optim.SGD([p], foreach=False, **kw),
                     dict(momentum=0.9, weight_decay=1e-3)),
    "sgd-nesterov": (FlashSGD, lambda p, **kw: torch.optim.SGD([p], foreach=False, **kw),
                     dict(momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "sgd-dampening": (FlashSGD, lambda p, **kw: torch.optim.SGD([p], foreach=False, **kw),
                      dict(momentum=0.9, dampening=0.5)),
    "sgd-plain": (FlashSGD, lambda p, **kw: torch.optim.SGD([p], foreach=False, **kw), dict(weight_decay=1e-3)),
    "sgdw": (FlashSGDW, lambda p, **kw: SGDW64(p, **kw), dict(momentum=0.9, weight_decay=0.1)),
    "lion": (FlashLion, lambda p, **kw: Lion64(p, **kw), dict(betas=(0.9, 0.99), weight_decay=0.1)),
}


MANTISSA = {"bf16": 8, "fp16": 11, "fp32": 24}


def _rounding(dtype: str, bits, max_abs: float) -> float:
    """Half a step of the master weight's grid at the largest |w|: rho's step with 24-bit master weights
    (2^-7 of half an ulp of the parameter format), the format's own half ulp without rho, fp32's for fp32."""
    e = torch.tensor(max_abs).log2().floor().item()
    if dtype == "fp32":
        return 2.0 ** (e - 24)
    half_ulp = 2.0 ** (e - MANTISSA[dtype])
    return half_ulp / 128 / 2 if bits == 24 else half_ulp


def _run_pair(variant, dtype, bits, quantize, companded=True, lr=LR, seed=0, per_step=0.0):
    """Run FlashX and its float64 reference on the same gradients. Returns the worst ratio, over steps k and
    rows, of |flash master - float64| to ``k * (per_step * lr * s + 2 * rounding)`` (s the row's gradient
    scale; rounding: the master weight's half step), the fraction of coordinates that end more than lr
    apart, and the final max |flash master - float64|."""
    cls, ref_cls, kwargs = VARIANTS[variant]
    w0, grads, scale = _problem(seed)
    p = torch.nn.Parameter(w0.to(DTYPES[dtype]))
    ref = torch.nn.Parameter(p.detach().double().clone())
    opt = cls([p], lr=lr, master_weight_bits=bits, quantize_states=quantize, companded=companded, **kwargs)
    ropt = ref_cls(ref, lr=lr, **kwargs)
    rounding = 2 * _rounding(dtype, bits, w0.abs().max().item() + 1.0)
    worst = 0.0
    for k, g in enumerate(grads, 1):
        p.grad = g.to(p.dtype)
        ref.grad = p.grad.double()
        opt.step()
        ropt.step()
        diff = (opt.master_weight(p).double() - ref.detach()).abs()
        worst = max(worst, (diff / (k * (per_step * lr * scale + rounding))).max().item())
    return worst, (diff > lr).double().mean().item(), diff.max().item()


MATRIX = [pytest.param(v, d, b, q, id=f"{v}-{d}-{b or 'nosplit'}-{'q' if q else 'fp32m'}")
          for v, d, b, q in itertools.product(VARIANTS, DTYPES, (24, None), (True, False))
          if not (d == "fp32" and b is None) and not (v == "lion" and b is None)]  # Lion without rho: below


@pytest.mark.parametrize("variant,dtype,bits,quantize", MATRIX)
def test_trajectory_vs_float64(variant, dtype, bits, quantize):
    if variant == "lion":
        # Lion moves every coordinate by exactly lr: with fp32 moments the signs agree with float64 and the
        # error is the master weight's rounding; an 8-bit momentum flips the sign of interpolations near zero
        # (a 2 lr difference at that step), which must stay rare. Without rho, lr-sized steps below half a
        # bf16/fp16 ulp are lost: test_rho_beats_plain_bf16.
        worst, flipped, _ = _run_pair(variant, dtype, bits, quantize, per_step=1e-3)
        if quantize:
            assert flipped < 0.05, flipped
        else:
            assert worst <= 1.0 and flipped == 0.0, (worst, flipped)
        return
    # The update is lr times a buffer of the gradients' size s: fp32 arithmetic puts a few ulps of it off
    # (1e-3 s), an 8-bit companded buffer a few percent of its group's absmax, which is <= 10 s with momentum
    # 0.9 (0.15 s); every step also rounds the master weight to its grid.
    per_step = 0.15 if quantize and variant != "sgd-plain" else 1e-3
    worst, _, _ = _run_pair(variant, dtype, bits, quantize, per_step=per_step)
    assert worst <= 1.0, f"error {worst:.3g} x the per-step bound"


@pytest.mark.parametrize("variant, lr", [("sgd-momentum", 1e-4), ("lion", 1e-3)])
def test_rho_beats_plain_bf16(variant, lr):
    """Steps far below bf16's spacing (2^-7 at |w| in [2, 4)): without rho most are lost, with rho (steps of
    2^-15 there) they add up."""
    errs = {bits: _run_pair(variant, "bf16", bits, False, lr=lr)[2] for bits in (24, None)}
    assert errs[24] < errs[None] / 10, errs


def test_first_sgd_step_buffer_is_the_gradient():
    p = torch.nn.Parameter(torch.randn(8, 64))
    opt = FlashSGD([p], lr=0.1, momentum=0.9, dampening=0.5, quantize_states=False)
    g = torch.randn(8, 64)
    p.grad = g.clone()
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], g)  # torch.optim.SGD: buf = grad, undamped


def test_sgd_without_momentum_keeps_no_buffer_and_memory_budget():
    w = torch.nn.Parameter(torch.randn(64, 256).bfloat16())
    plain = FlashSGD([w], lr=0.1)
    assert set(plain.state[w]) == {"step", "rho"}
    w.grad = torch.randn_like(w)
    plain.step()
    assert flashdist.memory_report(plain)["bytes_per_param"] == 5.0  # param 2 + rho 1 + grad 2
    for cls, kwargs in [(FlashSGD, dict(momentum=0.9)), (FlashLion, {})]:
        p = torch.nn.Parameter(torch.randn(64, 256).bfloat16())
        opt = cls([p], **kwargs)
        p.grad = torch.randn_like(p)
        opt.step()
        report = flashdist.memory_report(opt)
        assert report["codes"] == p.numel() and report["scales"] == 2 * 64 * 8
        kind = "flash_lion" if cls is FlashLion else "flash_sgd"
        assert report["bytes_per_param"] == flashdist.bytes_per_param(kind)["total"] == 6.0625


def test_bytes_per_param_family():
    assert flashdist.bytes_per_param("sgd")["total"] == 12
    assert flashdist.bytes_per_param("lion")["total"] == 12
    assert flashdist.bytes_per_param("flash_sgdw", gradient_release=True)["total"] == 4.0625
    assert flashdist.bytes_per_param("flash_lion", gradient_release=True)["total"] == 4.0625


def test_torch_sgd_state_dict_round_trip():
    """FlashSGD's portable state loads into torch.optim.SGD, and torch.optim.SGD's (no step count) loads back:
    the momentum buffer survives both ways up to 8-bit requantization, which is idempotent."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 64))
    flash = FlashSGD([p], lr=0.1, momentum=0.9)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        flash.step()
    sd = flash.state_dict()
    buf = sd["state"][0]["momentum_buffer"]
    assert buf.dtype == torch.float32 and buf.shape == p.shape
    q = torch.nn.Parameter(p.detach().clone())
    sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    sgd.load_state_dict(copy.deepcopy(sd))  # torch keeps the loaded tensor itself and steps it in place
    assert torch.equal(sgd.state[q]["momentum_buffer"], buf)
    g = torch.randn_like(p)
    q.grad = g.clone()
    sgd.step()  # a torch step from the loaded buffer: not a first step
    r = torch.nn.Parameter(p.detach().clone())
    back = FlashSGD([r], lr=0.1, momentum=0.9, quantize_states=False)
    back.load_state_dict(sd)
    r.grad = g.clone()
    back.step()
    assert torch.allclose(r, q, rtol=0, atol=1e-6)  # not a first step: the buffer was used

    # torch.optim.SGD's own state dict has no step count: it loads as "one step done"
    t = torch.nn.Parameter(torch.randn(16, 64))
    native = torch.optim.SGD([t], lr=0.1, momentum=0.9)
    t.grad = torch.randn_like(t)
    native.step()
    torch_sd = native.state_dict()
    assert "step" not in torch_sd["state"][0]
    u = torch.nn.Parameter(t.detach().clone())
    again = FlashSGD([u], lr=0.1, momentum=0.9, quantize_states=False)
    again.load_state_dict(torch_sd)
    assert again.state_dict()["state"][0]["step"].item() == 1.0
    t.grad = torch.randn_like(t)
    u.grad = t.grad.clone()
    native.step()
    again.step()
    assert torch.allclose(u, t, rtol=0, atol=1e-6)


def test_lion_state_dict_round_trip_mid_run_is_exact():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(8, 96).bfloat16())
    opt = FlashLion([p], lr=1e-3, weight_decay=0.1, state_dict_format="compressed")
    grads = [torch.randn(8, 96).bfloat16() for _ in range(6)]
    for g in grads[:3]:
        p.grad = g
        opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = FlashLion([q], lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(sd)
    for g in grads[3:]:
        p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q) and torch.equal(opt.state[p]["rho"], opt2.state[q]["rho"])
    assert torch.equal(opt.state[p]["exp_avg_codes"], opt2.state[q]["exp_avg_codes"])


def test_momentum_schedule_and_param_groups():
    """OneCycleLR cycles SGD's momentum: the value may change between steps (and lr with it)."""
    a = torch.nn.Parameter(torch.randn(4, 32))
    b = torch.nn.Parameter(torch.randn(4, 32))
    opt = FlashSGD([{"params": [a]}, {"params": [b], "lr": 0.05}], lr=0.1, momentum=0.9, quantize_states=False)
    ref_a, ref_b = (torch.nn.Parameter(t.detach().double().clone()) for t in (a, b))
    ref = torch.optim.SGD([{"params": [ref_a]}, {"params": [ref_b], "lr": 0.05}], lr=0.1, momentum=0.9,
                          foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)
    rsched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.2, total_steps=10)
    for _ in range(8):
        for p, r in ((a, ref_a), (b, ref_b)):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.double()
        opt.step()
        ref.step()
        sched.step()
        rsched.step()
    assert opt.param_groups[0]["momentum"] == ref.param_groups[0]["momentum"] != 0.9
    assert torch.allclose(a.double(), ref_a, atol=1e-5) and torch.allclose(b.double(), ref_b, atol=1e-5)


def test_switching_momentum_on_or_off_is_refused_before_any_change():
    p = torch.nn.Parameter(torch.randn(4, 32))
    q = torch.nn.Parameter(torch.randn(4, 32))
    opt = FlashSGD([{"params": [p]}, {"params": [q], "momentum": 0.9}], lr=0.1)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    before = (p.detach().clone(), q.detach().clone())
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(ValueError, match="momentum.*fixed at construction"):
        opt.step()
    opt.param_groups[0]["momentum"] = 0.0
    opt.param_groups[1]["momentum"] = 0.0
    with pytest.raises(ValueError, match="momentum.*fixed at construction"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])


@pytest.mark.parametrize("cls, kwargs, match", [
    (FlashSGD, dict(lr=-0.1), "lr"),
    (FlashSGD, dict(momentum=-0.9), "momentum"),
    (FlashSGD, dict(momentum=0.9, dampening=1.5), "dampening"),
    (FlashSGD, dict(nesterov=True), "nesterov"),
    (FlashSGD, dict(momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (FlashSGD, dict(nesterov="yes", momentum=0.9), "nesterov"),
    (FlashSGDW, dict(weight_decay=-1.0), "weight_decay"),
    (FlashLion, dict(betas=(1.5, 0.99)), r"betas\[0\]"),
    (FlashLion, dict(betas=(0.9,)), "betas"),
    (FlashLion, dict(weight_decay=float("nan")), "weight_decay"),
    (FlashLion, dict(state_dict_format="zip"), "state_dict_format"),
    (FlashSGD, dict(master_weight_bits=8), "master_weight_bits"),
], ids=["sgd-lr", "momentum", "dampening", "nesterov-no-momentum", "nesterov-dampening", "nesterov-type",
        "sgdw-wd", "lion-beta1", "lion-betas-len", "lion-wd-nan", "lion-format", "sgd-bits"])
def test_bad_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.randn(4, 8))], **kwargs)


def test_nonfinite_gradient_is_contained_and_counted():
    for cls, kwargs in [(FlashSGD, dict(momentum=0.9)), (FlashLion, {})]:
        p = torch.nn.Parameter(torch.randn(2, 64).bfloat16())
        opt = cls([p], lr=1e-2, **kwargs)
        p.grad = torch.randn_like(p)
        opt.step()
        before = {k: v.clone() for k, v in opt.state[p].items() if k != "step"}
        w = p.detach().clone()
        g = torch.randn_like(p)
        g[0, 5] = float("nan")  # group 0 of row 0
        p.grad = g
        opt.step()
        assert int(opt.skipped) == 1
        assert torch.equal(p[0, :32], w[0, :32]) and not torch.equal(p[0, 32:], w[0, 32:])
        for k, v in before.items():
            now = opt.state[p][k]
            assert torch.equal(now[0, :1] if k.endswith("_scales") else now[0, :32],
                               v[0, :1] if k.endswith("_scales") else v[0, :32]), k


@pytest.mark.parametrize("saved_momentum, momentum", [(0.0, 0.9), (0.9, 0.0)], ids=["off-into-on", "on-into-off"])
def test_load_that_would_switch_momentum_is_refused_before_any_change(saved_momentum, momentum):
    """A torch.optim.SGD state dict whose momentum is off (or on, before any step: no buffer saved) would
    switch FlashSGD's momentum under its state: refused, and the optimizer still steps."""
    src = torch.nn.Parameter(torch.randn(4, 32))
    sgd = torch.optim.SGD([src], lr=0.1, momentum=saved_momentum)
    if saved_momentum == 0:
        src.grad = torch.randn_like(src)
        sgd.step()
    p = torch.nn.Parameter(src.detach().clone())
    opt = FlashSGD([p], lr=0.1, momentum=momentum)
    with pytest.raises(ValueError, match="momentum"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["momentum"] == momentum
    p.grad = torch.randn_like(p)
    opt.step()
