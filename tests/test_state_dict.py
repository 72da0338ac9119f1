"""State-dict formats in one process: portable and compressed round trips, AdamW interop, validation."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from flashdist import FlashAdamW, PrecisionWarning, memory_report
from flashdist.checkpoint.state import FORMAT_VERSION


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 70),
                               torch.nn.LayerNorm(70), torch.nn.Linear(70, 4)).to(torch.bfloat16)


X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _train(model, opt, n):
    for _ in range(n):
        opt.zero_grad()
        model(X.to(model[0].weight.dtype)).float().square().mean().backward()
        opt.step()


def _trained(fmt, steps=3, **kw):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format=fmt, **kw)
    _train(model, opt, steps)
    return model, opt


def _state_equal(opt_a, model_a, opt_b, model_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key]), key


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
def test_round_trip_then_identical_steps(fmt):
    model, opt = _trained(fmt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    model2 = copy.deepcopy(model)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2, state_dict_format=fmt)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _state_equal(opt, model, opt2, model2)
    _train(model, opt, 3)
    _train(model2, opt2, 3)
    _state_equal(opt, model, opt2, model2)


def test_portable_layout_is_adamw_like():
    model, opt = _trained("portable")
    sd = opt.state_dict()
    w = model[0].weight
    entry = sd["state"][0]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "rho"}
    assert entry["exp_avg"].dtype == torch.float32 and entry["exp_avg"].shape == w.shape
    assert entry["rho"].dtype == torch.int8
    assert sd["param_groups"][0]["flashdist_format"] == "portable"
    assert sd["param_groups"][0]["flashdist_version"] == FORMAT_VERSION
    # the live state is untouched by state_dict()
    assert "exp_avg_codes" in opt.state[w]


def test_compressed_layout():
    model, opt = _trained("compressed")
    entry = opt.state_dict()["state"][0]
    assert set(entry) == {"step", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "rho"}
    assert entry["exp_avg_codes"].dtype == torch.int8 and entry["exp_avg_sq_scales"].dtype == torch.bfloat16


def test_requantizing_unchanged_state_gives_same_codes():
    model, opt = _trained("portable", steps=5)
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    opt.load_state_dict(opt.state_dict())
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, before[id(p)][k]), k


def test_compressed_and_portable_load_into_each_other():
    model, opt = _trained("compressed")
    model2 = copy.deepcopy(model)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2, state_dict_format="portable")
    opt2.load_state_dict(opt.state_dict())
    _state_equal(opt, model, opt2, model2)
    opt.load_state_dict(opt2.state_dict())
    _state_equal(opt, model, opt2, model2)


def test_portable_loads_into_torch_adamw():
    model, opt = _trained("portable")
    ref = copy.deepcopy(model).float()
    for p, q in zip(model.parameters(), ref.parameters()):
        q.data.copy_(opt.master_weight(p))
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry.pop("rho")  # the documented path (docs/checkpoints.md): the fp32 masters carry it
    adamw.load_state_dict(sd)
    st = adamw.state[ref[0].weight]
    assert st["exp_avg"].shape == ref[0].weight.shape and float(st["step"]) == 3 and "rho" not in st
    _train(ref, adamw, 1)  # AdamW steps from the loaded moments


def test_adamw_state_dict_loads_into_flash():
    torch.manual_seed(0)
    ref = _model().float()
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, adamw, 3)
    model = _model().to(torch.bfloat16)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(adamw.state_dict())
    w = model[0].weight
    back = opt.state_dict()["state"][0]["exp_avg"]
    exact = adamw.state[ref[0].weight]["exp_avg"]
    assert torch.allclose(back, exact, atol=exact.abs().amax() / 100)
    assert float(opt.state[w]["step"]) == 3


def test_newer_version_is_refused_and_nothing_changes():
    model, opt = _trained("compressed")
    sd = copy.deepcopy(opt.state_dict())
    snapshot = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["flashdist_version"] = FORMAT_VERSION + 1
    sd["state"][0]["exp_avg_codes"].zero_()
    with pytest.raises(ValueError, match="version"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for pid, st in snapshot["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v)


@pytest.mark.parametrize("mutate, match", [
    (lambda sd: sd["state"][2].__setitem__("exp_avg_codes", sd["state"][2]["exp_avg_codes"].float()), "exp_avg_codes"),
    (lambda sd: sd["state"][0].__setitem__("rho", sd["state"][0]["rho"].to(torch.int16)), "rho"),
    (lambda sd: sd["state"][0].pop("exp_avg_scales"), "exp_avg_scales"),
    (lambda sd: sd["state"][0].__setitem__("max_exp_avg_sq", torch.zeros(1)), "unexpected"),
    (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), "param groups"),
    (lambda sd: sd["param_groups"][0]["params"].pop(), "parameters"),
    (lambda sd: sd["param_groups"][0].__setitem__("master_weight_bits", 32), "master_weight_bits"),
], ids=["codes-dtype", "rho-dtype", "missing-scales", "extra-key", "groups", "params", "bits"])
def test_mismatches_name_the_parameter_and_change_nothing(mutate, match):
    model, opt = _trained("compressed")
    named = FlashAdamW(model.named_parameters(), lr=1e-2, state_dict_format="compressed")
    named.load_state_dict(opt.state_dict())
    sd = copy.deepcopy(named.state_dict())
    snapshot = copy.deepcopy(sd)
    mutate(sd)
    with pytest.raises(ValueError, match=match) as err:
        named.load_state_dict(sd)
    if "state" in match or match in ("exp_avg_codes", "rho", "exp_avg_scales"):
        assert "'0." in str(err.value) or "'2." in str(err.value)  # the parameter's name
    after = named.state_dict()
    for pid, st in snapshot["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v)


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (0,)], ids=["3x0", "0x5", "0"])
@pytest.mark.parametrize("flat", [False, True], ids=["rows", "flat"])
def test_an_empty_parameter_steps_saves_and_loads(shape, flat):
    empty = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
    weight = torch.nn.Parameter(torch.ones(4, 40, dtype=torch.bfloat16))
    opt = FlashAdamW([empty, weight], lr=1e-2, flat_layout=flat)
    empty.grad, weight.grad = torch.zeros_like(empty), torch.ones_like(weight)
    opt.step()
    for fmt in ("portable", "compressed"):
        sd = opt.state_dict(format=fmt)
        twin_weight = torch.nn.Parameter(weight.detach().clone())
        twin = FlashAdamW([torch.nn.Parameter(empty.detach().clone()), twin_weight], lr=1e-2, flat_layout=flat)
        twin.load_state_dict(copy.deepcopy(sd))
        assert float(twin.state[twin_weight]["step"]) == 1
        opt.load_state_dict(sd)
    torch.optim.AdamW([empty, weight]).load_state_dict(opt.state_dict())
    opt.step()
    assert float(opt.state[empty]["step"]) == 2 and memory_report(opt)["numel"] == 160


def _set(key, value, index=0):
    def mutate(sd):
        entry = sd["state"][index]
        entry[key] = value if not callable(value) else value(entry[key])
    return mutate


@pytest.mark.parametrize("fmt, mutate, match", [
    ("portable", _set("step", torch.tensor(-5.0)), "'step' of '0.weight' .* is -5.0"),
    ("portable", _set("step", 2.5), "'step' of '0.weight' .* is 2.5"),
    ("portable", _set("step", float("nan")), "'step' of '0.weight' .* is nan"),
    ("portable", _set("exp_avg", lambda t: t.index_fill(1, torch.tensor([3]), float("nan"))),
     "'exp_avg' of '0.weight' .* holds 40 values that are not finite"),
    ("portable", _set("exp_avg_sq", lambda t: t.index_fill(1, torch.tensor([0]), -1.0)),
     "'exp_avg_sq' of '0.weight' .* holds 40 values that are not finite and non-negative"),
    ("portable", _set("exp_avg", lambda t: t.index_fill(0, torch.tensor([0]), float("inf")), index=3),
     r"'exp_avg' of '2.bias' .* holds 1 values"),
    ("compressed", _set("exp_avg_sq_scales", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))),
     "'exp_avg_sq_scales' of '0.weight'"),
    ("compressed", _set("exp_avg_scales", lambda t: -t), "'exp_avg_scales' of '0.weight' .* non-negative"),
], ids=["step-negative", "step-fraction", "step-nan", "exp_avg-nan", "exp_avg_sq-negative", "fp32-moment-inf",
        "scales-inf", "scales-negative"])
def test_loaded_state_out_of_range_is_refused_naming_it_and_changes_nothing(fmt, mutate, match):
    # a step count of -5 made the next step spin forever; NaN, infinite or negative moments made every later
    # step skip their group
    model, opt = _trained(fmt)
    named = FlashAdamW(model.named_parameters(), lr=1e-2, state_dict_format=fmt)
    named.load_state_dict(opt.state_dict())
    sd = copy.deepcopy(named.state_dict())
    snapshot = copy.deepcopy(sd)
    mutate(sd)
    with pytest.raises(ValueError, match=match):
        named.load_state_dict(sd)
    after = named.state_dict()
    for pid, st in snapshot["state"].items():
        assert all(torch.equal(after["state"][pid][k], v) for k, v in st.items())


# ----- the parameter dtype rho was made for ------------------------------------------------------------------


def test_state_dicts_record_each_parameter_dtype():
    model, opt = _trained("portable")
    model[3].float()  # a LayerNorm kept in fp32
    group = FlashAdamW(model.parameters()).state_dict()["param_groups"][0]
    assert group["flashdist_version"] == FORMAT_VERSION == 2
    assert group["flashdist_param_dtypes"] == ["bfloat16"] * 4 + ["float32"] * 2 + ["bfloat16"] * 2


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
def test_bf16_state_with_rho_into_an_fp32_parameter_makes_it_the_exact_master(fmt):
    # PEFT's load_adapter upcasts bf16 adapters to fp32 before the Trainer loads the optimizer's state
    model, opt = _trained(fmt)
    masters = [opt.master_weight(p) for p in model.parameters()]
    upcast = copy.deepcopy(model).float()
    with pytest.warns(PrecisionWarning, match="fp32 parameters"):
        fp32 = FlashAdamW(upcast.parameters(), lr=1e-2, state_dict_format=fmt)
    fp32.load_state_dict(opt.state_dict())
    for p, master in zip(upcast.parameters(), masters):
        assert torch.equal(p.detach(), master) and "rho" not in fp32.state[p]
    # weights that are not the saved bf16 values (not loaded yet): refused, nothing changed
    other = _model(seed=3).float()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.rand_like(p) * 1e-3)  # fp32 values off the bf16 grid
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.warns(PrecisionWarning, match="fp32 parameters"), \
            pytest.raises(ValueError, match="does not hold torch.bfloat16 values.*load the model's weights before"):
        FlashAdamW(other.parameters(), lr=1e-2).load_state_dict(opt.state_dict())
    assert all(torch.equal(p, b) for p, b in zip(other.parameters(), before))


def test_fp32_state_into_a_bf16_parameter_gives_rho_0():
    model = _model().float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # (fp32 parameters: no 24-bit split, on purpose)
        opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    flash = FlashAdamW(bf16.parameters(), lr=1e-2)
    _train(bf16, flash, 1)  # a rho of its own, which the load must not keep
    bf16.load_state_dict(model.state_dict())
    flash.load_state_dict(opt.state_dict())
    assert all(not flash.state[p]["rho"].any() for p in bf16.parameters())
    assert all(torch.equal(flash.master_weight(p), p.float()) for p in bf16.parameters())


@pytest.mark.parametrize("saved, loaded", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=["bf16-into-fp16", "fp16-into-bf16"])
def test_state_between_bf16_and_fp16_is_refused(saved, loaded):
    # rho counts in the spacing of the dtype it was made for: loaded across, the masters were 0.43 bf16 (7.4
    # fp16) spacings off without a word
    model, opt = _trained("portable")
    model = model.to(saved)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    other = copy.deepcopy(model).to(loaded)
    with pytest.raises(ValueError, match=f"saved for a {saved} parameter and this one is {loaded}"):
        FlashAdamW(other.parameters(), lr=1e-2).load_state_dict(opt.state_dict())


def test_a_version_1_state_dict_is_taken_as_saved_for_the_current_dtypes():
    model, opt = _trained("compressed")
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        group["flashdist_version"] = 1
        del group["flashdist_param_dtypes"]
    twin = copy.deepcopy(model)
    twin_opt = FlashAdamW(twin.parameters(), lr=1e-2, state_dict_format="compressed")
    twin_opt.load_state_dict(sd)
    _state_equal(opt, model, twin_opt, twin)


def test_a_dcp_checkpoint_of_bf16_state_into_fp16_parameters_is_refused(tmp_path):
    from flashdist import checkpoint

    model, opt = _trained("compressed")
    checkpoint.save(tmp_path / "ck", model, opt)
    half = copy.deepcopy(model).half()
    fresh = FlashAdamW(half.parameters(), lr=1e-2, state_dict_format="compressed")
    with pytest.raises(Exception, match="saved for a torch.bfloat16 parameter and this one is torch.float16"):
        checkpoint.load(tmp_path / "ck", half, fresh)
    assert len(fresh.state) == 0  # the refused load left nothing behind


def test_a_dcp_checkpoint_of_bf16_state_into_fp32_parameters_is_refused_in_one_line(tmp_path):
    # through flashdist.checkpoint the loading optimizer's keys decide what is read, and an fp32 parameter keeps
    # no rho: refused (the conversion runs where the Trainer loads, optimizer.load_state_dict after the model)
    from flashdist import checkpoint

    model, opt = _trained("portable")
    checkpoint.save(tmp_path / "ck", model, opt)
    fp32 = _model(seed=4).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        fresh = FlashAdamW(fp32.parameters(), lr=1e-2)
    with pytest.raises(checkpoint.CheckpointError, match="has rho, this optimizer keeps no rho"):
        checkpoint.load(tmp_path / "ck", fp32, fresh)


def test_a_flattened_state_dict_into_an_optimizer_without_state_says_what_to_do():
    """torch rebuilds a flattened optimizer state dict from the keys of the live state: into an optimizer with
    no state yet (state is made at the first step) every parameter's state arrives empty. The load says so and
    what to do, and after optimizer.state_dict() (which makes the state) the same dict loads exactly."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    models = [torch.nn.Linear(32, 16).bfloat16() for _ in range(2)]
    opts = [FlashAdamW(m.parameters(), state_dict_format="compressed") for m in models]
    models[0](torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
    opts[0].step()
    sd = get_optimizer_state_dict(models[0], opts[0], options=flat)
    with pytest.raises(ValueError, match=r"is empty: with flatten_optimizer_state_dict=True.*optimizer.state_dict\(\) "
                       "first"):
        set_optimizer_state_dict(models[1], opts[1], sd, options=flat)
    opts[1].state_dict()
    set_optimizer_state_dict(models[1], opts[1], sd, options=flat)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert all(torch.equal(v, opts[1].state[q][k]) for k, v in opts[0].state[p].items())
