"""Param groups take every form torch.optim accepts, and bad hyper-parameters or parameter sets are refused
at construction (or, for layout options changed on a live group, at the next step) with a clear error."""

from __future__ import annotations

import io
import math
from fractions import Fraction

import pytest
import torch

from flashdist import FlashAdamW, FlashLion, FlashSGD


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8)).to(torch.bfloat16)


def _groups(model: torch.nn.Sequential, form: str):
    """Two groups (the second without weight decay) with ``params`` in the given form."""
    a, b = model[0], model[1]
    forms = {
        "list": lambda m: list(m.parameters()),
        "tuple": lambda m: tuple(m.parameters()),
        "generator": lambda m: m.parameters(),
        "named-generator": lambda m: m.named_parameters(),
        "tensor": lambda m: m.weight,
    }
    return [{"params": forms[form](a)}, {"params": forms[form](b), "weight_decay": 0.0}]


def _step(model, opt, seed=1):
    torch.manual_seed(seed)
    model(torch.randn(4, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("form", ["list", "tuple", "generator", "named-generator", "tensor"])
def test_every_iterable_form_trains_like_a_list(form):
    ref_model, model = _model(), _model()
    ref = FlashAdamW(_groups(ref_model, "tensor" if form == "tensor" else "list"), lr=1e-2, weight_decay=0.1)
    opt = FlashAdamW(_groups(model, form), lr=1e-2, weight_decay=0.1)
    want = 2 if form != "tensor" else 1
    assert [len(g["params"]) for g in opt.param_groups] == [want, want]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    if form == "named-generator":
        assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    before = [p.detach().clone() for p in model.parameters()]
    for seed in range(2):
        _step(ref_model, ref, seed)
        _step(model, opt, seed)
    for p, q, old in zip(model.parameters(), ref_model.parameters(), before):
        if any(p is t for g in opt.param_groups for t in g["params"]):
            assert not torch.equal(p.detach(), old), "a parameter given to the optimizer did not train"
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("form", ["list", "generator", "named-generator"])
def test_single_group_forms(form):
    model = _model()
    params = {"list": list(model.parameters()), "generator": model.parameters(),
              "named-generator": model.named_parameters()}[form]
    opt = FlashSGD(params, lr=0.1, momentum=0.9)
    assert len(opt.param_groups[0]["params"]) == 4
    assert len(opt.state) == 0  # made at the first step, as torch.optim makes it
    assert len(opt.state_dict()["state"]) == 4 and len(opt.state) == 4


def test_add_param_group_takes_a_generator():
    model = _model()
    opt = FlashLion(model[0].parameters())
    opt.add_param_group({"params": model[1].parameters(), "lr": 1e-3})
    assert len(opt.param_groups[1]["params"]) == 2 and opt.param_groups[1]["lr"] == 1e-3
    opt.state_dict()
    assert all(p in opt.state for p in model[1].parameters())


def test_a_spent_generator_is_refused():
    model = _model()
    spent = model[1].parameters()
    list(spent)
    with pytest.raises(ValueError, match="yields no parameters"):
        FlashAdamW([{"params": model[0].parameters()}, {"params": spent}])


def test_a_set_is_refused():
    with pytest.raises(TypeError, match="not a set"):
        FlashAdamW([{"params": set(_model().parameters())}])


# ----- hyper-parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value", [("lr", math.inf), ("lr", math.nan), ("eps", math.inf),
                                        ("weight_decay", -math.inf), ("weight_decay", math.inf)])
def test_non_finite_hyperparameters_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite"):
        FlashAdamW(_model().parameters(), **{name: value})


def test_non_finite_lr_set_on_a_live_group_is_refused_at_the_step_and_changes_nothing():
    model = _model()
    opt = FlashAdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = float("inf")
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match="lr must be a finite"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_eps_zero_is_refused():
    # torch.optim.AdamW accepts eps=0 and returns NaN for any coordinate with a zero gradient history; with
    # 8-bit second moments a zero code under a non-zero first moment would give inf
    with pytest.raises(ValueError, match="eps must be > 0"):
        FlashAdamW(_model().parameters(), eps=0.0)


@pytest.mark.parametrize("key,value", [("master_weight_bits", 32), ("master_weight_bits", None),
                                       ("quantize_states", False), ("companded", False), ("flat_layout", True)])
def test_layout_options_changed_on_a_live_group_are_refused_at_the_step(key, value):
    model = _model()
    opt = FlashAdamW(model.parameters())
    _step(model, opt)
    state_before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    opt.param_groups[0][key] = value
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match=f"layout options of a param group changed.*{key}"):
        opt.step()
    assert all(torch.equal(opt.state[model[0].weight][k], v) for k, v in state_before.items())
    opt.param_groups[0][key] = {"master_weight_bits": 24, "flat_layout": False}.get(key, True)
    opt.step()  # set back: steps again


# ----- overlapping parameters -----------------------------------------------------------------------------


def test_overlapping_views_are_refused_naming_both():
    base = torch.zeros(8, 32, dtype=torch.bfloat16)
    top = torch.nn.Parameter(base[:5])
    bottom = torch.nn.Parameter(base[4:])
    with pytest.raises(ValueError, match=r"'top'.*'bottom'.*overlap"):
        FlashAdamW([("top", top), ("bottom", bottom)])
    opt = FlashAdamW([("top", top)])
    with pytest.raises(ValueError, match="overlap"):
        opt.add_param_group({"params": [("bottom", bottom)]})
    assert len(opt.param_groups) == 1  # refused group left nothing behind


def test_disjoint_views_of_one_storage_are_fine():
    base = torch.zeros(8, 32, dtype=torch.bfloat16)
    opt = FlashAdamW([torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[4:])])
    assert len(opt.state_dict()["state"]) == 2


def test_unnamed_positions_name_their_group_and_mixed_names_are_refused():
    w, b = _model()[0].weight, _model()[0].bias
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* \(also as "
                       r"param_groups\[0\]\['params'\]\[0\]\)"):
        FlashAdamW([{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match=r"param_groups\[0\]'s params mix \(name, parameter\) pairs and bare tensors "
                       r"\(entry 1 is a bare Parameter\)"):
        FlashAdamW([("w", w), b])
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] is a tuple that is not a \(name, parameter\) pair"):
        FlashAdamW([(w, "w")])


def test_a_state_dict_naming_the_same_parameters_grouped_otherwise_is_refused_not_mixed():
    """Saved and live groups that both name their parameters, with the same names in another grouping or
    order (groups built by an earlier rule), would load by position into the wrong parameters (silently where
    the shapes agree) or fail with a misleading count: refused in one line naming a parameter and both places,
    nothing changed. Names that differ (another wrapping) load by position and the live names stay."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(8, 32).bfloat16()) for _ in range(3))
    saved = FlashAdamW([{"params": [("a", a), ("b", b)]}, {"params": [("c", c)]}])
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    saved.step()
    sd = saved.state_dict()
    for groups, where in (([{"params": [("b", b), ("a", a)]}, {"params": [("c", c)]}], r"\[0\]\['params'\]\[0\]"),
                          ([{"params": [("a", a)]}, {"params": [("b", b), ("c", c)]}], r"\[1\]\['params'\]\[0\]")):
        live = FlashAdamW(groups)
        with pytest.raises(ValueError, match=r"grouped or ordered otherwise.*'b' is param_groups\[0\]\['params'\]"
                           rf"\[1\] there and param_groups{where} here"):
            live.load_state_dict(sd)
        assert len(live.state) == 0
    spare = {**sd, "param_groups": [*sd["param_groups"], {**sd["param_groups"][1], "params": [], "param_names": []}]}
    with pytest.raises(ValueError, match="the state dict has 3 param groups, this optimizer has 2"):
        FlashAdamW([{"params": [("a", a), ("b", b)]}, {"params": [("c", c)]}]).load_state_dict(spare)  # (only an
        # empty group apart: the count says it)
    other = FlashAdamW([{"params": [("x.a", a), ("x.b", b)]}, {"params": [("x.c", c)]}])
    other.load_state_dict(sd)
    assert other.param_groups[0]["param_names"] == ["x.a", "x.b"] and torch.equal(
        other.state[b]["exp_avg_codes"], saved.state[b]["exp_avg_codes"])


@pytest.mark.parametrize("cls", [FlashAdamW, FlashLion, FlashSGD], ids=lambda c: c.__name__)
@pytest.mark.parametrize("key", ["maximize", "amsgrad", "differentiable"])
def test_torch_options_no_update_implements_are_refused_not_ignored(cls, key):
    """A group copied from a torch optimizer's config may set maximize / amsgrad / differentiable: no flashdist
    update reads them, so a group that sets one true is refused (at construction, and at the step when set on a
    live group), where it would have descended silently; False, as torch's state dicts hold them, is fine."""
    model = _model()
    with pytest.raises(ValueError, match=f"sets {key}=True, which {cls.__name__} does not implement"):
        cls([{"params": list(model.parameters()), key: True}])
    opt = cls([{"params": list(model.parameters()), key: False}])
    _step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][key] = True
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("cls", [FlashAdamW, FlashSGD], ids=lambda c: c.__name__)
def test_a_strided_gradient_where_the_step_reads_flat_storage_is_refused_before_any_group_steps(cls):
    """backend="cpu" (the fused CPU step, no fallback) reads tensors as flat storage, as the Triton kernels
    do: a gradient that is not contiguous, in the second group, is refused in one line before the first group
    steps (its weights, state and step count unchanged); made contiguous, the step runs once. The same for a
    parameter whose storage became strided after construction."""
    model = _model()
    opt = cls([{"params": [model[0].weight]}, {"params": [model[1].weight], "lr": 1e-3}], backend="cpu")
    model[0].weight.grad = torch.randn_like(model[0].weight)
    model[1].weight.grad = torch.randn(model[1].weight.shape[::-1]).bfloat16().t()
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* has a gradient that is not "
                       r"contiguous .* backend 'cpu' reads flat storage") as refused:
        opt.step()
    assert "\n" not in str(refused.value) and torch.equal(model[0].weight.detach(), before)
    assert float(opt.state[model[0].weight].get("step", 0)) == 0
    model[1].weight.grad = model[1].weight.grad.contiguous()
    opt.step()
    assert float(opt.state[model[0].weight]["step"]) == 1
    # a parameter's storage made strided after construction (p.data replaced, as model.to(memory_format=...) does)
    model[1].weight.data = model[1].weight.data.t().contiguous().t()
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* has storage that is not contiguous"):
        opt.step()
    assert torch.equal(model[0].weight.detach(), before)


# ----- the same tensor twice, and scalars that overflow fp32 ----------------------------------------------


def test_a_parameter_given_twice_is_refused_naming_it():
    # torch.optim.AdamW refuses a tensor in two groups and only warns about one twice in a group, then steps
    # it twice with step 1's bias correction: flashdist refuses both before anything is built
    model = _model()
    w = model[0].weight
    with pytest.raises(ValueError, match=r"'0.weight' .* twice in one param group \(also as '0.weight'\)"):
        FlashAdamW(list(model.named_parameters()) + [("0.weight", w)])
    with pytest.raises(ValueError, match="in two param groups"):
        FlashAdamW([{"params": [w]}, {"params": [w, model[0].bias]}])
    opt = FlashAdamW([w])
    with pytest.raises(ValueError, match="in two param groups"):
        opt.add_param_group({"params": [model[0].bias, w]})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"].append(w)  # put in behind the optimizer's back: refused at the step
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match="twice in one param group"):
        opt.step()


@pytest.mark.parametrize("cls,kwargs,match", [
    (FlashAdamW, dict(lr=1e38), r"lr is too large: the first step's step size lr / \(1 - betas\[0\]\)"),
    (FlashAdamW, dict(lr=1e30, weight_decay=1e10), r"lr is too large: lr \* weight_decay"),
    (FlashAdamW, dict(eps=1e39), "eps=1e[+]39 overflows fp32"),
    (FlashLion, dict(lr=1e39), "lr=1e[+]39 overflows fp32"),
    (FlashSGD, dict(lr=1.0, weight_decay=1e39), "weight_decay=1e[+]39 overflows fp32"),
], ids=["adamw-lr-1e38", "adamw-lr-times-wd", "adamw-eps", "lion-lr", "sgd-weight_decay"])
def test_hyperparameters_whose_scalars_overflow_fp32_are_refused(cls, kwargs, match):
    # torch.optim.AdamW(lr=1e38) fails at its step ("value cannot be converted to type float without
    # overflow"); flashdist would write inf weights and count no skipped group
    with pytest.raises(ValueError, match=match):
        cls(_model().parameters(), **kwargs)
    torch.optim.AdamW(_model().parameters(), lr=1e37)  # the largest accepted are accepted by both
    FlashAdamW(_model().parameters(), lr=3e37)


_NUMPY_OPTIONS = {"adamw": (FlashAdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-8}),
                  "sgd": (FlashSGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}),
                  "lion": (FlashLion, {"lr": 1e-3, "weight_decay": 0.1}),
                  "muon": (None, {"lr": 2e-2, "momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5})}


@pytest.mark.parametrize("kind", _NUMPY_OPTIONS)
def test_numpy_scalars_are_taken_as_the_numbers_they_hold(kind):
    """Hyper-parameters given as NumPy scalars (np.float32, np.int64: torch.optim takes them, and configs
    read with NumPy hand them over), at construction or set by a schedule: the bits of the same Python numbers."""
    np = pytest.importorskip("numpy")
    from flashdist import FlashMuon, muon_param_groups

    cls, options = _NUMPY_OPTIONS[kind]
    as_numpy = {k: np.int64(v) if isinstance(v, int) else np.float32(v) for k, v in options.items()}
    as_python = {k: v.item() for k, v in as_numpy.items()}
    runs = []
    for values in (as_python, as_numpy):
        model = _model()
        opt = (FlashMuon(muon_param_groups(model), **values) if cls is None else cls(model.parameters(), **values))
        _step(model, opt, seed=1)
        for group in opt.param_groups:
            group["lr"] = values["lr"] * (np.float32(0.5) if values is as_numpy else 0.5)
        _step(model, opt, seed=2)
        runs.append([p.detach().clone() for p in model.parameters()])
        buffer = io.BytesIO()  # saved as the Python numbers: torch.load's weights_only=True refuses NumPy objects
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        assert torch.load(buffer, weights_only=True)["param_groups"][0]["lr"] == values["lr"] * 0.5
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_any_real_number_is_taken_as_its_float():
    """A Fraction (numbers.Real, no .item()) as the learning rate: the bits of its float."""
    runs = []
    for lr in (Fraction(1, 64), 1 / 64):
        model = _model()
        _step(model, FlashSGD(model.parameters(), lr=lr, momentum=0.9), seed=1)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
