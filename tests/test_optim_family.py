"""FlashSGD, FlashSGDW and FlashLion: what only they do as torch optimizers (SGD's first buffer, momentum
schedules, torch.optim.SGD state dicts, momentum that cannot switch on or off), their memory and non-finite
gradients. Their trajectories, backends, odd shapes, state dict round trips, non-finite gradients and bad
hyperparameters are tests/test_optim.py's, over the cases of tests/cases.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import flashdist
from flashdist import FlashLion, FlashSGD

# the SGD tests compare with torch.optim.SGD on fp32 parameters on purpose (their own masters)
pytestmark = pytest.mark.filterwarnings("ignore:.*FlashSGD got fp32 parameters:flashdist.PrecisionWarning")


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
    w.grad = torch.randn_like(w)
    plain.step()
    assert set(plain.state[w]) == {"step", "rho"}
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


@pytest.mark.parametrize("schedule", ["CyclicLR", "OneCycleLR"])
def test_momentum_schedule_on_momentum_free_sgd_trains_as_torch(schedule):
    """FlashSGD(momentum=0) under CyclicLR / OneCycleLR's default cycle_momentum: the schedule turns momentum
    on, and the buffer starts as torch.optim.SGD's (the gradient), before or after steps without momentum."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 32))
    ref_p = torch.nn.Parameter(p.detach().double().clone())
    opt = FlashSGD([p], lr=0.1, quantize_states=False)
    ref = torch.optim.SGD([ref_p], lr=0.1)
    p.grad = torch.randn_like(p)
    ref_p.grad = p.grad.double()
    opt.step()  # a step without momentum first: the buffer is made later
    ref.step()
    make = {"CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=3),
            "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=10)}[schedule]
    sched, rsched = make(opt), make(ref)
    for _ in range(6):
        p.grad = torch.randn_like(p)
        ref_p.grad = p.grad.double()
        opt.step()
        ref.step()
        sched.step()
        rsched.step()
    assert opt.param_groups[0]["momentum"] == ref.param_groups[0]["momentum"] != 0
    assert "momentum_buffer" in opt.state[p]
    assert torch.allclose(p.double(), ref_p, atol=1e-5)


def test_momentum_switches_that_torch_would_not_match_are_refused_before_any_change():
    p = torch.nn.Parameter(torch.randn(4, 32))
    q = torch.nn.Parameter(torch.randn(4, 32))
    opt = FlashSGD([{"params": [p], "dampening": 0.5}, {"params": [q], "momentum": 0.9}], lr=0.1)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    before = (p.detach().clone(), q.detach().clone())
    opt.param_groups[0]["momentum"] = 0.5  # a zero buffer with dampening would not start as torch's
    with pytest.raises(ValueError, match="momentum.*dampening=0.5"):
        opt.step()
    opt.param_groups[0]["momentum"] = 0.0
    opt.param_groups[1]["momentum"] = 0.0  # would drop a live buffer
    with pytest.raises(ValueError, match="momentum.*not set it to 0"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])


def test_load_of_momentum_on_before_any_step_turns_the_buffer_on():
    """A torch.optim.SGD state dict with momentum on but no buffer yet (saved before its first step) loads into
    a FlashSGD(momentum=0): the buffer is made at the next step, as torch would make it."""
    src = torch.nn.Parameter(torch.randn(4, 32))
    sgd = torch.optim.SGD([src], lr=0.1, momentum=0.9)
    p = torch.nn.Parameter(src.detach().clone())
    opt = FlashSGD([p], lr=0.1, quantize_states=False)
    opt.load_state_dict(sgd.state_dict())
    for _ in range(2):
        p.grad = torch.randn_like(p)
        src.grad = p.grad.clone()
        opt.step()
        sgd.step()
    assert torch.allclose(p, src, atol=1e-6)


@pytest.mark.parametrize("saved_momentum, momentum", [(0.0, 0.9)], ids=["off-into-on"])
def test_load_that_would_switch_momentum_is_refused_before_any_change(saved_momentum, momentum):
    """A torch.optim.SGD state dict whose momentum is off would drop FlashSGD's live momentum buffer: refused,
    and the optimizer still steps."""
    src = torch.nn.Parameter(torch.randn(4, 32))
    sgd = torch.optim.SGD([src], lr=0.1, momentum=saved_momentum)
    if saved_momentum == 0:
        src.grad = torch.randn_like(src)
        sgd.step()
    p = torch.nn.Parameter(src.detach().clone())
    opt = FlashSGD([p], lr=0.1, momentum=momentum)
    p.grad = torch.randn_like(p)
    opt.step()  # (before its first step the optimizer holds no state, and takes the saved momentum as torch does)
    with pytest.raises(ValueError, match="momentum"):
        opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["momentum"] == momentum
    p.grad = torch.randn_like(p)
    opt.step()
