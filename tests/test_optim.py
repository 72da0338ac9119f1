"""Every flashdist optimizer through one runner, over the cases of tests/cases.py: the trajectory against its
float64 reference (torch.optim.AdamW / Adam / SGD, a float64 SGDW and Lion) within the error model stated
there, every backend bit for bit against the eager reference, odd shapes, and state_dict round trips in the
middle of a run. Then FlashAdamW's own behaviour as a torch optimizer, and bad input.

The Triton backend runs under the interpreter on CPU (tests/_interpreter.py): in this process where that
took, else in a child process (``test_in_interpreter_process``).
"""

from __future__ import annotations

import _interpreter  # first: it decides whether this process interprets triton  # isort: skip

import copy
from dataclasses import replace

import pytest
import torch

import flashdist
from flashdist import FlashAdamW, FlashLion, FlashSGD, FlashSGDW
from flashdist.kernels import cpu
from tests.cases import CASES, DTYPES, OPTIMIZERS, Case, run_pair

# fp32 parameters here are deliberate (their own master weights, compared with torch.optim); the warning that
# tells a user to cast to bf16 is asserted in tests/test_state_lifecycle.py
pytestmark = pytest.mark.filterwarnings("ignore:flashdist. .* got fp32 parameters:UserWarning")

# ----- the runner ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_trajectory_vs_float64(case):
    result = run_pair(case)
    assert result.ratio <= 1.0, f"error {result.ratio:.3g} x the per-step bound"
    if case.opt.max_flipped is not None and case.moments != "fp32m":
        # an 8-bit momentum flips the sign of interpolations near zero: that must stay rare
        assert result.flipped < case.opt.max_flipped, result.flipped


# the fused CPU step over the whole matrix; the Triton kernel once per optimizer (tests/test_triton_kernel.py
# holds its matrix, at the level of the kernel)
BACKEND_CASES = ([replace(c, backend="cpu") for c in CASES if "cpu" in c.opt.backends]
                 + [Case(o, backend="triton") for o in OPTIMIZERS.values() if "triton" in o.backends])
# optimizers whose step on a value reads only its own group (a non-finite or huge gradient is skipped per group);
# FlashMuon's reads its whole matrix: tests/test_muon.py holds its non-finite case
ELEMENTWISE = [name for name, o in OPTIMIZERS.items() if o.elementwise]


def _stepped(case: Case, backend: str, steps: int = 2) -> list[torch.Tensor]:
    """Parameters, master weights and state after ``steps`` steps on a matrix with odd rows and a 1-d tensor
    (gradients from 1e-4 to 1e2 across groups)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(DTYPES[case.dtype]))
              for shape in ((5, 70), (7,))]
    opt = replace(case, backend=backend).make(params)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 3, p.shape, generator=gen)
                      ).to(p.dtype)
        opt.step()
    return [t for p in params for t in (p.detach(), opt.master_weight(p), *opt.state[p].values())]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.interpreted) if c.backend == "triton" else c
                                  for c in BACKEND_CASES], ids=lambda c: c.id)
def test_backend_matches_reference_bitwise(case):
    if case.backend == "cpu" and not cpu.available():
        pytest.skip(f"the fused CPU step is not built here ({cpu.build_error()}): CPU steps run the reference")
    if case.backend == "triton" and not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    got, want = _stepped(case, case.backend), _stepped(case, "reference")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs from the reference's"


@pytest.mark.interpreter_runner
def test_in_interpreter_process():
    """The triton cases above, in a child process that interprets triton (tests/_interpreter.py)."""
    if not _interpreter.HAS_TRITON:
        pytest.skip("triton is not installed")
    done = _interpreter.run_interpreted(__file__, "-k", "test_backend_matches_reference_bitwise and triton")
    ran = sum(c.backend == "triton" for c in BACKEND_CASES)
    assert done.returncode == 0 and f"{ran} passed" in done.stdout, done.stdout[-6000:] + done.stderr[-3000:]


SHAPES = [(1,), (31,), (33,), (4097,), (3, 5, 7), (0,), (0, 4), (5, 1), ()]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_odd_shapes(name, shape):
    """Partial, single-value and empty groups, rows of one value, 0-d and 3-d tensors."""
    result = run_pair(Case(OPTIMIZERS[name]), shape=shape, steps=5)
    assert result.ratio <= 1.0, f"error {result.ratio:.3g} x the per-step bound"


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_round_trip_mid_run_is_exact(name, fmt):
    """Three steps, a state dict into a fresh optimizer, three more steps in both: the same bits. Portable
    moments are re-quantized on load, which gives back the codes they came from."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16()) for shape in ((16, 96), (16,))]
    grads = [[torch.randn(p.shape, generator=gen).bfloat16() for p in params] for _ in range(6)]
    case = Case(OPTIMIZERS[name])
    opt = case.make(params, state_dict_format=fmt)

    def train(o, ps, gs):
        for step in gs:
            for p, g in zip(ps, step):
                p.grad = g.clone()
            o.step()

    train(opt, params, grads[:3])
    sd = copy.deepcopy(opt.state_dict())
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = case.make(params2)
    opt2.load_state_dict(sd)
    for p, p2 in zip(params, params2):
        assert {k: v.dtype for k, v in opt.state[p].items()} == {k: v.dtype for k, v in opt2.state[p2].items()}
    train(opt, params, grads[3:])
    train(opt2, params2, grads[3:])
    for p, p2 in zip(params, params2):
        assert torch.equal(p, p2)
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], opt2.state[p2][key]), key


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_nonfinite_gradient_skips_its_group_only(name):
    """A NaN in one group of 32: that group's weights and state keep their bits (the element's alone where no
    8-bit moments are kept, as for SGD without momentum), the skip is counted, every other value steps."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(2, 64, generator=gen).bfloat16())
    opt = Case(OPTIMIZERS[name]).make([p])
    p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items() if k != "step"}
    w, master = p.detach().clone(), opt.master_weight(p).clone()
    g = torch.randn(p.shape, generator=gen).bfloat16()
    g[0, 5] = float("nan")  # group 0 of row 0
    p.grad = g
    opt.step()
    assert int(opt.skipped) == 1
    grouped = any(v.shape != p.shape for v in before.values())  # per-group scales: 8-bit moments
    kept = torch.zeros(p.shape, dtype=torch.bool)
    kept[0, slice(0, 32) if grouped else 5] = True
    assert torch.equal(p[kept], w[kept]) and torch.equal(opt.master_weight(p)[kept], master[kept])
    assert (opt.master_weight(p) != master)[~kept].all()
    for key, old in before.items():
        # per-value tensors (codes, rho) hold the group in [0, :32]; per-group ones (scales) in [0, 0]
        where = kept if old.shape == p.shape else (0, 0)
        assert torch.equal(opt.state[p][key][where], old[where]), key


@pytest.mark.parametrize("name, lr, steps", [("adamw", 1e-2, 30), ("sgd-momentum", 1e-4, 20), ("lion", 1e-3, 20)])
def test_rho_beats_plain_bf16(name, lr, steps):
    """Steps near or far below bf16's spacing (2^-7 at |w| in [2, 4)): without rho most are lost or
    distorted, with rho (steps of 2^-15 there) they add up."""
    errs = {bits: run_pair(Case(OPTIMIZERS[name], bits=bits, moments="fp32m"), lr=lr, steps=steps).final
            for bits in (24, None)}
    assert errs[24] < errs[None] / 10, errs


def test_unquantized_32bit_is_near_exact():
    result = run_pair(Case(OPTIMIZERS["adamw"], bits=32, moments="fp32m"))
    assert result.per_step < 1e-3  # 2^-24-relative master weights: only fp32 rounding is left


def test_linear_ablation_is_worse():
    comp = run_pair(Case(OPTIMIZERS["adamw"])).per_step
    linear = run_pair(Case(OPTIMIZERS["adamw"], moments="q-linear")).per_step
    assert comp < linear / 3, (comp, linear)


# ----- FlashAdamW's own behaviour -------------------------------------------------------------------------


def test_fp32_params_have_no_rho_and_quantized_moments():
    p = torch.nn.Parameter(torch.randn(8, 64))
    opt = FlashAdamW([p])
    opt.ensure_state(p)  # (state is made at the first step, or by ensure_state)
    assert "rho" not in opt.state[p]
    assert opt.state[p]["exp_avg_codes"].dtype == torch.int8
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.master_weight(p).dtype == torch.float32
    assert torch.equal(opt.master_weight(p), p.detach())


def test_state_layout_and_memory_report():
    p = torch.nn.Parameter(torch.randn(64, 256).bfloat16())
    bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = FlashAdamW([p, bias])
    opt.ensure_state(p)  # (state is made at the first step, or by ensure_state)
    opt.ensure_state(bias)
    st = opt.state[p]
    assert st["exp_avg_codes"].shape == p.shape and st["exp_avg_scales"].shape == (64, 8)
    assert st["exp_avg_scales"].dtype == torch.bfloat16 and st["rho"].dtype == torch.int8
    assert opt.state[bias]["exp_avg"].dtype == torch.float32  # 1-d: fp32 moments
    p.grad = torch.randn_like(p)
    bias.grad = torch.randn_like(bias)
    opt.step()
    rep = flashdist.memory_report(opt)
    n = p.numel() + bias.numel()
    assert rep["numel"] == n
    assert rep["params"] == 2 * n and rep["grads"] == 2 * n and rep["rho"] == n
    assert rep["codes"] == 2 * p.numel() and rep["scales"] == 2 * 2 * 64 * 8
    assert rep["fp32_moments"] == 8 * bias.numel()
    expected = (2 + 2 + 1) * n + 2 * p.numel() + 2 * 2 * 64 * 8 + 8 * bias.numel()
    assert rep["total"] == expected
    # the 2-d weight alone is at the analytic budget
    assert abs((expected - 13 * bias.numel()) / p.numel() - flashdist.bytes_per_param("flash_adamw")["total"]) < 1e-9


def test_bytes_per_param_table():
    assert flashdist.bytes_per_param("adamw")["total"] == 16
    assert flashdist.bytes_per_param("flash_adamw")["total"] == 7.125
    assert flashdist.bytes_per_param("flash_adamw", gradient_release=True)["total"] == 5.125
    assert flashdist.bytes_per_param("flash_sgd")["total"] == 6.0625
    with pytest.raises(ValueError, match="unknown optimizer kind"):
        flashdist.bytes_per_param("lamb")


@pytest.mark.parametrize("magnitude", [1e-10, 1e4], ids=["tiny", "huge"])
def test_tiny_and_huge_gradients_keep_momentum(magnitude):
    """Rare embedding rows (1e-10) and large gradients (1e4): moments survive the group scales, and the
    step matches float64 AdamW."""
    p = torch.nn.Parameter(torch.ones(4, 64, dtype=torch.bfloat16))
    ref = torch.nn.Parameter(torch.ones(4, 64, dtype=torch.float64))
    opt = FlashAdamW([p], lr=1e-2, weight_decay=0.0)
    ropt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = (torch.rand(4, 64, generator=g, dtype=torch.float64) + 0.5) * magnitude
        p.grad = grad.to(torch.bfloat16)
        ref.grad = p.grad.double()
        opt.step()
        ropt.step()
    st = opt.state[p]
    assert (st["exp_avg_codes"] != 0).all() and (st["exp_avg_sq_codes"] != 0).all()
    assert (st["exp_avg_scales"].float() > 0).all() and torch.isfinite(st["exp_avg_sq_scales"].float()).all()
    assert torch.allclose(opt.master_weight(p).double(), ref.detach(), atol=5 * 0.05 * 1e-2)
    # every master weight moved against its (positive) gradient, also where the step is below bf16's spacing
    assert (opt.master_weight(p) < 1).all()


def test_nonfinite_gradient_is_contained_and_counted():
    p = torch.nn.Parameter(torch.randn(4, 96, dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    opt = FlashAdamW([p, bias], lr=1e-2)
    for _ in range(2):
        p.grad, bias.grad = torch.randn_like(p), torch.randn_like(bias)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    p_before, b_before = p.detach().clone(), opt.master_weight(bias).clone()
    grad = torch.randn_like(p)
    grad[1, 40] = float("nan")  # row 1, group 1
    grad[3, 70] = float("inf")  # row 3, group 2
    bgrad = torch.randn_like(bias)
    bgrad[5] = float("-inf")
    p.grad, bias.grad = grad, bgrad
    opt.step()
    st = opt.state[p]
    bad = torch.zeros(4, 96, dtype=torch.bool)
    bad[1, 32:64] = True
    bad[3, 64:96] = True
    assert torch.equal(p.detach()[bad], p_before[bad])
    assert not torch.equal(p.detach()[~bad], p_before[~bad])
    for key in ("exp_avg_codes", "exp_avg_sq_codes", "rho"):
        assert torch.equal(st[key][bad], before[key][bad])
    assert st["exp_avg_scales"][1, 1] == before["exp_avg_scales"][1, 1]
    assert st["exp_avg_sq_scales"][3, 2] == before["exp_avg_sq_scales"][3, 2]
    assert torch.isfinite(st["exp_avg_scales"].float()).all() and torch.isfinite(st["exp_avg_sq_scales"].float()).all()
    assert torch.isfinite(p).all() and torch.isfinite(bias).all()
    b_after = opt.master_weight(bias)
    assert b_after[5] == b_before[5] and (b_after != b_before).sum() == 7
    assert int(opt.skipped) == 3  # two groups of the matrix + one element of the 1-d bias


def test_update_of_first_moments_far_below_their_group():
    """8-bit moments: Adam's update works on each group's first moments scaled by the power of two that brings
    the group's absmax into [1, 2), and takes scaled values below 2^-48 as 0 (what lets the kernel divide
    without range checks). With a tiny eps (where the update of a tiny moment is not negligible), a value
    2^-53 below its group's largest does not move; one 2^-40 below does, and so does a group of tiny values."""
    p = torch.nn.Parameter(torch.full((3, 32), 0.5))
    g = torch.ones(3, 32)
    g[0, 1] = 2.0**-53
    g[1, 1] = 2.0**-40
    g[2] = 2.0**-53
    p.grad = g
    opt = FlashAdamW([p], lr=1e-2, eps=1e-30, weight_decay=0.0)
    opt.step()
    moved = p.detach() != 0.5
    assert not moved[0, 1] and moved[0, 0] and moved[1, 1] and moved[2].all()
    assert torch.allclose(p.detach()[2], torch.full((32,), 0.49), atol=1e-6)  # Adam's first step: lr * sign(g)


def _tiny_model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4)).to(dtype)


def test_trains_a_model_like_torch_adamw():
    """A small regression task: FlashAdamW on a bf16 model ends within 10% of torch.optim.AdamW on fp32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 4, generator=g))
    losses = {}
    for name in ("flash", "adamw"):
        model = _tiny_model(torch.bfloat16 if name == "flash" else torch.float32)
        opt = (FlashAdamW if name == "flash" else torch.optim.AdamW)(model.parameters(), lr=3e-3, weight_decay=0.01)
        for i in range(300):
            idx = torch.arange(i * 64, (i + 1) * 64) % 512
            loss = torch.nn.functional.mse_loss(model(x[idx].to(model[0].weight.dtype)).float(), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            losses[name] = torch.nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).item()
    first = torch.nn.functional.mse_loss(_tiny_model(torch.float32)(x), y).item()
    assert losses["adamw"] < first / 3
    assert losses["flash"] <= losses["adamw"] * 1.10 + 1e-3, losses


def test_param_groups_schedulers_and_grads_none():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 32))
    b = torch.nn.Parameter(torch.randn(8, 32))
    frozen = torch.nn.Parameter(torch.randn(8, 32))
    ra, rb = (torch.nn.Parameter(t.detach().double().clone()) for t in (a, b))
    opt = FlashAdamW([{"params": [a, frozen], "lr": 1e-2}, {"params": [b], "lr": 1e-3, "weight_decay": 0.0}],
                     quantize_states=False)
    ropt = torch.optim.AdamW([{"params": [ra], "lr": 1e-2}, {"params": [rb], "lr": 1e-3, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    frozen_before = frozen.detach().clone()
    for k in range(6):
        ga, gb = torch.randn(8, 32), torch.randn(8, 32)
        a.grad, ra.grad = ga, ga.double()
        if k % 2 == 0:  # b has no grad on odd steps: its step count and bias correction lag, as in torch
            b.grad, rb.grad = gb, gb.double()
        opt.step()
        ropt.step()
        sched.step()
        rsched.step()
        opt.zero_grad(set_to_none=(k % 3 != 0))
        ropt.zero_grad()
        if k % 3 == 0:
            assert a.grad is not None and (a.grad == 0).all()
            a.grad = None
            b.grad = None
    assert torch.allclose(a.double(), ra, atol=1e-5) and torch.allclose(b.double(), rb, atol=1e-5)
    assert opt.state[b]["step"].item() == 3 and opt.state[a]["step"].item() == 6
    assert torch.equal(frozen.detach(), frozen_before) and float(opt.state[frozen].get("step", 0)) == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    model = _tiny_model()
    opt = FlashAdamW(model.parameters())
    sd = copy.deepcopy(opt.state_dict())
    other = FlashAdamW(_tiny_model().parameters(), master_weight_bits=32)
    with pytest.raises(ValueError, match="master_weight_bits"):
        other.load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["state"][2]["exp_avg"] = bad["state"][2]["exp_avg"][:-1]
    snapshot = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for pid, st in snapshot["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v)


# ----- bad input ------------------------------------------------------------------------------------------


def _param(dtype=torch.bfloat16, shape=(4, 8)):
    return torch.nn.Parameter(torch.randn(shape).to(dtype))


@pytest.mark.parametrize("cls, kwargs, match", [
    (FlashAdamW, dict(lr=-1e-3), "lr"),
    (FlashAdamW, dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (FlashAdamW, dict(betas=(0.9, -0.1)), r"betas\[1\]"),
    (FlashAdamW, dict(betas=(0.9,)), "betas"),
    (FlashAdamW, dict(eps=-1e-8), "eps"),
    (FlashAdamW, dict(weight_decay=-0.1), "weight_decay"),
    (FlashAdamW, dict(master_weight_bits=16), "master_weight_bits"),
    (FlashAdamW, dict(companded="yes"), "companded"),
    (FlashAdamW, dict(backend="cuda"), "backend"),
    (FlashSGD, dict(lr=-0.1), "lr"),
    (FlashSGD, dict(momentum=-0.9), "momentum"),
    (FlashSGD, dict(momentum=0.9, dampening=1.5), "dampening"),
    (FlashSGD, dict(nesterov=True), "nesterov"),
    (FlashSGD, dict(momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (FlashSGD, dict(nesterov="yes", momentum=0.9), "nesterov"),
    (FlashSGD, dict(master_weight_bits=8), "master_weight_bits"),
    (FlashSGDW, dict(weight_decay=-1.0), "weight_decay"),
    (FlashLion, dict(betas=(1.5, 0.99)), r"betas\[0\]"),
    (FlashLion, dict(betas=(0.9,)), "betas"),
    (FlashLion, dict(weight_decay=float("nan")), "weight_decay"),
    (FlashLion, dict(state_dict_format="zip"), "state_dict_format"),
], ids=["lr", "beta1", "beta2", "betas-len", "eps", "wd", "bits", "companded", "backend", "sgd-lr", "momentum",
        "dampening", "nesterov-no-momentum", "nesterov-dampening", "nesterov-type", "sgd-bits", "sgdw-wd",
        "lion-beta1", "lion-betas-len", "lion-wd-nan", "lion-format"])
def test_bad_hyperparameters(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls([_param()], **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int32), requires_grad=False), "dtype"),
    (lambda: torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64)), "dtype"),
    (lambda: torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64)), "dtype"),
    (lambda: torch.nn.Parameter(torch.zeros(8, 4).t()), "contiguous"),
], ids=["int", "complex", "fp64", "non-contiguous"])
def test_bad_params_named(make, match):
    named = [("good.weight", _param()), ("layer.bad", make())]
    with pytest.raises((TypeError, ValueError), match=rf"'layer\.bad'.*{match}|{match}.*'layer\.bad'"):
        FlashAdamW(named)


def test_bad_param_group_leaves_optimizer_unchanged():
    good = _param()
    opt = FlashAdamW([good])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [_param()], "lr": -1.0})
    with pytest.raises(TypeError, match="dtype"):
        opt.add_param_group({"params": [_param(), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1 and len(opt.state) == 0  # (no state before the first step)


def test_sparse_grad_refused_before_any_change():
    a, b = _param(), _param()
    opt = FlashAdamW([("a", a), ("b", b)])
    a.grad = torch.randn_like(a)
    b.grad = torch.randn(4, 8).to(torch.bfloat16).to_sparse()
    a_before = a.detach().clone()
    with pytest.raises(RuntimeError, match="'b'.*sparse"):
        opt.step()
    assert torch.equal(a.detach(), a_before) and float(opt.state[a].get("step", 0)) == 0


def test_lr_changed_to_invalid_between_steps_is_refused():
    a = _param()
    opt = FlashAdamW([a])
    a.grad = torch.randn_like(a)
    opt.param_groups[0]["lr"] = -1.0
    before = a.detach().clone()
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert torch.equal(a.detach(), before)


def test_master_weight_of_unknown_tensor():
    opt = FlashAdamW([_param()])
    with pytest.raises(KeyError, match="not a parameter"):
        opt.master_weight(torch.zeros(2))


def test_step_counts_follow_each_parameter_when_the_set_with_grads_changes():
    """Steps over [a, b], [a], [a, b]: a has taken 3 steps and b 2, as with torch.optim.AdamW (bias
    corrections by each parameter's own count), whichever cached step plans were used."""
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(4, 64)) for _ in range(2))
    ra, rb = (torch.nn.Parameter(t.detach().double().clone()) for t in (a, b))
    opt = FlashAdamW([a, b], lr=1e-2, quantize_states=False, master_weight_bits=32)
    ref = torch.optim.AdamW([ra, rb], lr=1e-2, foreach=False)
    for with_grad in ([a, b], [a], [a, b], [b], [a, b]):
        for p, r in ((a, ra), (b, rb)):
            p.grad = torch.randn_like(p) if any(p is q for q in with_grad) else None
            r.grad = p.grad.double() if p.grad is not None else None
        opt.step()
        ref.step()
    assert int(opt.state[a]["step"]) == 4 and int(opt.state[b]["step"]) == 4
    assert torch.allclose(a.double(), ra, atol=1e-6) and torch.allclose(b.double(), rb, atol=1e-6)


# ----- finite gradients whose step overflows fp32 -----------------------------------------------------------

# the largest finite gradient of each dtype; 1e30 for those that hold it
HUGE = {torch.bfloat16: (1e30, torch.finfo(torch.bfloat16).max), torch.float16: (torch.finfo(torch.float16).max,),
        torch.float32: (1e30, torch.finfo(torch.float32).max)}
OVERFLOW_OPTIONS = {  # (param dtype, options of Optimizer.make)
    "bf16-q-comp": (torch.bfloat16, {}),
    "bf16-q-linear": (torch.bfloat16, dict(moments="q-linear")),
    "bf16-fp32m": (torch.bfloat16, dict(moments="fp32m")),
    "bf16-32bit": (torch.bfloat16, dict(bits=32)),
    "bf16-nosplit-flat": (torch.bfloat16, dict(bits=None, flat_layout=True)),
    "fp16-q-comp": (torch.float16, {}),
    "fp16-fp32m-32bit": (torch.float16, dict(moments="fp32m", bits=32)),
    "fp32-q-comp": (torch.float32, {}),
    "fp32-fp32m-flat": (torch.float32, dict(moments="fp32m", flat_layout=True)),
}


def _all_finite(opt, params) -> bool:
    tensors = [p.detach() for p in params] + [opt.master_weight(p) for p in params]
    tensors += [v for p in params for v in opt.state[p].values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


@pytest.mark.parametrize("options", OVERFLOW_OPTIONS)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_finite_gradients_never_make_a_weight_or_state_non_finite(name, options):
    """Gradients up to the largest finite value of their dtype, in one element and in a whole tensor: the
    parameters, master weights and state stay finite at every step, a group whose step would overflow is
    skipped and counted like a NaN gradient's, the values of other groups step, and the normal steps that
    follow train every value again (also those of the skipped groups)."""
    dtype, kwargs = OVERFLOW_OPTIONS[options]
    for value in HUGE[dtype]:
        gen = torch.Generator().manual_seed(3)
        # small weights and lr 1e-2: fine spacing and large steps, so that single steps move them also
        # without rho
        w = torch.nn.Parameter((torch.randn(4, 64, generator=gen) * 0.05).to(dtype))
        b = torch.nn.Parameter((torch.randn(8, generator=gen) * 0.05).to(dtype))
        params = [w, b]
        opt = OPTIMIZERS[name].make(params, lr=1e-2, **kwargs)

        def step(huge_w=None, huge_b=None):
            for p, huge in ((w, huge_w), (b, huge_b)):
                g = torch.randn(p.shape, generator=gen)
                if huge is not None:
                    g = huge(g)
                p.grad = g.to(dtype)
            before = [opt.master_weight(p).clone() for p in params]
            opt.step()
            assert _all_finite(opt, params), f"non-finite value after a step with {value:g}"
            return [opt.master_weight(p) != x for p, x in zip(params, before)]

        def one(g):
            g = g.clone()
            g.view(-1)[5] = value
            return g

        step()
        step()
        moved_w, _ = step(huge_w=one)
        assert moved_w[2:].float().mean() > 0.9, "values of other rows must still step"
        step(huge_w=lambda g: torch.full_like(g, value), huge_b=lambda g: -torch.full_like(g, value))
        start = [opt.master_weight(p).clone() for p in params]
        for _ in range(3):
            step()
        for p, x in zip(params, start):
            # SGD applies a huge gradient that fits (as torch.optim.SGD does): weights it sent far away no
            # longer move visibly; every other value trains again
            normal = x.abs() < 1e3
            moved = (opt.master_weight(p) != x)[normal]
            assert not normal.any() or moved.float().mean() > 0.95, "after the huge gradients, normal steps " \
                                                                       "train every value"


def test_overflowing_gradient_against_torch_adamw():
    """A gradient of 1e30 in one element: torch.optim.AdamW stays finite with an infinite second moment and
    an update of 0 there (for the rest of training); flashdist skips that group's step once, counts it, and
    steps every other group like torch."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 64)
    p = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt = FlashAdamW([p], lr=1e-2, quantize_states=False)  # fp32 moments: the element is its own group
    ropt = torch.optim.AdamW([ref], lr=1e-2)
    for k in range(3):
        g = torch.randn(4, 64)
        if k == 1:
            g[0, 5] = 1e30
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ropt.step()
    assert torch.isinf(ropt.state[ref]["exp_avg_sq"][0, 5]) and torch.isfinite(ref).all()
    st = opt.state[p]
    assert int(opt.skipped) == 1 and torch.isfinite(st["exp_avg_sq"]).all() and torch.isfinite(p).all()
    others = torch.ones(4, 64, dtype=torch.bool)
    others[0, 5] = False
    assert torch.allclose(p.detach()[others], ref.detach()[others], atol=1e-5)
