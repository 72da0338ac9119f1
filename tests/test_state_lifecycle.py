"""The optimizer's state follows the parameters in ``param_groups``, and the optimizer behaves like a
torch.optim.Optimizer where clients use it: frameworks swapping parameters (Accelerate's FSDP2 flow, shown
on 2 ranks in tests/distributed/test_accelerate_fsdp2.py), frozen parameters, state-dict and load hooks,
copy.deepcopy and pickle, torch.compile(optimizer.step), the fp32-parameter precision warning."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import sys
import types
import warnings
import weakref

import pytest
import torch

import flashdist
import flashdist.optim.base
import flashdist.optim.lifecycle
from flashdist import FlashAdamW, FlashSGD, PrecisionWarning, memory_report


def _model(seed: int = 0, dtype=torch.bfloat16) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dtype)


def _backward(model, seed: int) -> None:
    torch.manual_seed(100 + seed)
    x = torch.randn(4, 32, dtype=next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()


def _train(model, opt, steps: int, start: int = 0) -> None:
    for seed in range(start, start + steps):
        _backward(model, seed)
        opt.step()
        opt.zero_grad()


def _state_bits(opt, params) -> list[dict]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


# ----- state follows param_groups ---------------------------------------------------------------------------


def _swap_like_accelerate(opt, new_params: dict) -> None:
    """What accelerate's FSDP2 prepare does to a built optimizer: first every entry is replaced in place by
    a placeholder, then each group's list by a new list of the new parameters."""
    old = [list(g["params"]) for g in opt.param_groups]
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype)
    for group, params in zip(opt.param_groups, old):
        group["params"] = [new_params[id(p)] for p in params]


def test_no_state_before_the_first_step_and_swapped_out_parameters_are_freed():
    # torch.optim.AdamW holds nothing before its first step; under Accelerate's FSDP2 the optimizer is built on
    # the unsharded model, so state made at construction (and references to those tensors) would hold the
    # full model's bytes on every rank until the first step
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    adamw = torch.optim.AdamW(_model().parameters())
    assert len(opt.state) == 0 and not adamw.state
    assert opt.state  # empty but true: DCP's get_optimizer_state_dict then takes no zero-gradient step
    report = memory_report(opt)
    assert report["total"] == report["params"] and report["rho"] == report["codes"] == 0
    old = weakref.ref(model[0].weight)
    clone = copy.deepcopy(model)
    _swap_like_accelerate(opt, {id(p): q for p, q in zip(model.parameters(), clone.parameters())})
    del model
    gc.collect()
    assert old() is None, "the optimizer keeps a swapped-out parameter alive"
    _train(clone, opt, 1)
    assert set(map(id, opt.state)) == set(map(id, clone.parameters()))


def test_torch_dcp_state_dict_before_the_first_step_takes_no_step():
    # get_optimizer_state_dict makes the state of an optimizer whose state is empty by a zero-gradient step
    # with lr 0, which counts as step 1 (and so changes every later bias correction)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    sd = get_optimizer_state_dict(model, opt)
    assert sorted(sd["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(float(s["step"]) == 0 for s in sd["state"].values())
    assert all(float(opt.state[p]["step"]) == 0 and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_a_checkpoint_taken_before_the_first_step_has_every_key_and_resumes_exactly(how, tmp_path):
    from flashdist import checkpoint

    model = _model()
    opt = FlashAdamW(model.named_parameters(), lr=1e-2)
    if how == "state_dict":
        saved = copy.deepcopy(opt.state_dict())
        assert sorted(saved["state"]) == [0, 1, 2, 3]  # every trainable parameter (dcp.save: same keys everywhere)
        assert all(float(s["step"]) == 0 and s["rho"].abs().sum() == 0 for s in saved["state"].values())
    else:
        checkpoint.save(tmp_path / "ck", model, opt)
    assert all(float(opt.state[p]["step"]) == 0 for p in model.parameters())  # saving took no step
    resumed_model = _model(seed=3)
    resumed = FlashAdamW(resumed_model.named_parameters(), lr=1e-2)
    if how == "state_dict":
        resumed_model.load_state_dict(model.state_dict())
        resumed.load_state_dict(saved)
    else:
        checkpoint.load(tmp_path / "ck", resumed_model, resumed)
    _train(model, opt, 2)
    _train(resumed_model, resumed, 2)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.master_weight(p), resumed.master_weight(q))
        assert float(resumed.state[q]["step"]) == 2


def test_swapped_parameters_get_state_and_departed_ones_lose_it():
    model, twin = _model(), _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    ref = FlashAdamW(twin.parameters(), lr=1e-2)
    _train(model, opt, 2)
    _train(twin, ref, 2)
    # a new model object holding the same values (like sharded copies), swapped into the optimizer
    clone = copy.deepcopy(model)
    _swap_like_accelerate(opt, {id(p): q for p, q in zip(model.parameters(), clone.parameters())})
    # first sight at state_dict: no KeyError (torch.optim's state_dict would raise one), state for the new
    # parameters only, fresh (step 0), and the old tensors' state is gone
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3}
    assert all(float(s["step"]) == 0 for s in sd["state"].values())
    assert set(map(id, opt.state)) == set(map(id, clone.parameters()))
    report = memory_report(opt)
    assert report["numel"] == sum(p.numel() for p in clone.parameters())
    assert report["codes"] == 2 * sum(p.numel() for p in clone.parameters() if p.ndim == 2)
    # and it trains: the moments start again from zero, so compare with a fresh optimizer on a fresh twin
    fresh_model = copy.deepcopy(clone)
    fresh = FlashAdamW(fresh_model.parameters(), lr=1e-2)
    _train(clone, opt, 2, start=2)
    _train(fresh_model, fresh, 2, start=2)
    for p, q in zip(clone.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(a, b) for a, b in zip(opt.state[p].values(), fresh.state[q].values()))
    assert not any(torch.equal(p, q) for p, q in zip(clone.parameters(), model.parameters()) if p.ndim == 2)


def test_state_follows_parameters_in_a_load_and_in_the_memory_report():
    model, other = _model(), _model(seed=1)
    opt = FlashAdamW(model.parameters())
    _train(model, opt, 1)
    saved = opt.state_dict()
    opt.param_groups[0]["params"] = list(other.parameters())
    # the departed parameters' state is freed; the new ones get theirs at their first step, as in torch.optim
    assert memory_report(opt)["rho"] == 0 and len(opt.state) == 0
    opt.load_state_dict(saved)  # into the swapped-in parameters' fresh state
    assert set(map(id, opt.state)) == set(map(id, other.parameters()))
    assert memory_report(opt)["rho"] == sum(p.numel() for p in other.parameters())  # bf16: one int8 each
    assert all(float(opt.state[p]["step"]) == 1 for p in other.parameters())


def test_a_parameter_replaced_in_place_in_the_list_is_seen_at_its_step():
    model, clone = _model(), _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    old = model[0].weight
    opt.param_groups[0]["params"][0] = clone[0].weight  # same list object, one entry replaced
    model[0].weight = clone[0].weight
    _train(model, opt, 1, start=1)
    assert float(opt.state[clone[0].weight]["step"]) == 1 and float(opt.state[model[2].weight]["step"]) == 2
    assert old not in opt.state


def test_flat_layout_partitions_swapped_in_and_out_keep_their_state():
    # DeepSpeed ZeRO-3 puts each sub-group's flat partition into the group for its step and empties the group
    # after it: the state of those partitions is DeepSpeed's to keep
    parts = [torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(2)]
    opt = FlashAdamW([parts[0]], flat_layout=True)
    for _ in range(2):
        for p in parts:
            p.grad = torch.randn_like(p)
            opt.param_groups[0]["params"] = [p]
            opt.step()
            opt.param_groups[0]["params"] = []
            memory_report(opt)
    assert all(float(opt.state[p]["step"]) == 2 and "rho" in opt.state[p] for p in parts)


def test_an_unchanged_step_does_no_per_parameter_work(monkeypatch):
    model = _model()
    opt = FlashAdamW(model.parameters())
    _train(model, opt, 1)
    calls = []
    monkeypatch.setattr(opt, "_init_state", lambda *a: calls.append(a))
    monkeypatch.setattr(opt, "_state_ready", lambda *a: calls.append(a))
    monkeypatch.setattr(flashdist.optim.base, "check_param", lambda *a: calls.append(a))
    monkeypatch.setattr(flashdist.optim.lifecycle, "check_param", lambda *a: calls.append(a))
    _train(model, opt, 3, start=1)
    assert not calls


# ----- frozen parameters ------------------------------------------------------------------------------------


def test_frozen_parameters_hold_no_state_until_trained():
    model = _model()
    frozen = model[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    assert len(opt.state) == 0 and memory_report(opt)["numel"] == sum(p.numel() for p in model.parameters())
    _train(model, opt, 1)
    assert set(map(id, opt.state)) == set(map(id, model[2].parameters()))
    assert memory_report(opt)["rho"] == sum(p.numel() for p in model[2].parameters())
    assert not any(p in opt.state for p in frozen.parameters())
    sd = opt.state_dict()  # like torch.optim: frozen parameters have no entry
    assert set(sd["state"]) == {2, 3}
    # unfrozen: a state dict taken before its first step already holds its state (dcp.save needs the same
    # keys on every rank, and every rank unfreezes the same parameters), then it trains
    frozen.weight.requires_grad_(True)
    assert set(opt.state_dict()["state"]) == {0, 2, 3}
    before = frozen.weight.detach().clone()
    _train(model, opt, 1, start=1)
    assert float(opt.state[frozen.weight]["step"]) == 1
    assert not torch.equal(before, frozen.weight.detach())


def test_a_parameter_unfrozen_between_steps_gets_state_at_its_first_step():
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = FlashSGD(model.parameters(), lr=1e-2, momentum=0.9)
    _train(model, opt, 1)
    model[0].weight.requires_grad_(True)
    _train(model, opt, 1, start=1)
    assert "momentum_buffer_codes" in opt.state[model[0].weight]


# ----- hooks ----------------------------------------------------------------------------------------------


def test_state_dict_hooks_see_and_replace_the_returned_dict():
    model = _model()
    opt = FlashAdamW(model.parameters())
    _train(model, opt, 1)
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(("pre", o is opt)))

    def post(o, sd):
        seen.append(("post", sorted(sd["state"][0])))
        return {**sd, "extra": 1}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert seen == [("pre", True), ("post", ["exp_avg", "exp_avg_sq", "rho", "step"])]
    assert sd["extra"] == 1


def test_load_state_dict_hooks_fire_and_a_pre_hook_may_replace_the_dict():
    model = _model()
    opt = FlashAdamW(model.parameters())
    _train(model, opt, 2)
    saved = opt.state_dict()
    seen = []

    def pre(o, sd):
        seen.append("pre")
        assert "renamed" in sd
        sd = dict(sd)
        sd["state"] = sd.pop("renamed")
        return sd

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda o: seen.append(("post", float(o.state[model[0].weight]["step"]))))
    fresh = FlashAdamW(model.parameters())
    fresh.register_load_state_dict_pre_hook(pre)
    fresh.register_load_state_dict_post_hook(lambda o: seen.append(("post", float(o.state[model[0].weight]["step"]))))
    renamed = {"param_groups": saved["param_groups"], "renamed": saved["state"]}
    fresh.load_state_dict(renamed)
    assert seen == ["pre", ("post", 2.0)]
    assert "renamed" in renamed  # the caller's dict is not changed


# ----- copies and pickling --------------------------------------------------------------------------------


def test_deepcopy_steps_and_is_independent():
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    model_copy = copy.deepcopy(model)
    both = copy.deepcopy({"model": model, "opt": opt})  # a copy of the pair shares the copied parameters
    opt_copy = both["opt"]
    assert all(p is q for p, q in zip(both["model"].parameters(), opt_copy.param_groups[0]["params"]))
    _train(model, opt, 2, start=2)
    _train(both["model"], opt_copy, 2, start=2)
    for p, q in zip(model.parameters(), both["model"].parameters()):
        assert torch.equal(p, q)
        assert float(opt_copy.state[q]["step"]) == 4 and float(opt.state[p]["step"]) == 4
    assert opt_copy.backend == opt.backend and opt_copy.state_dict_format == opt.state_dict_format
    assert not torch.equal(model_copy[0].weight, model[0].weight)


def test_pickle_round_trip_of_model_and_optimizer_trains_on():
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format="compressed")
    _train(model, opt, 2)
    buffer = io.BytesIO()
    pickle.dump((model, opt), buffer)
    model2, opt2 = pickle.loads(buffer.getvalue())
    assert opt2.state_dict_format == "compressed"
    _train(model, opt, 1, start=2)
    _train(model2, opt2, 1, start=2)
    assert all(p is q for p, q in zip(model2.parameters(), opt2.param_groups[0]["params"]))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


# ----- torch.compile --------------------------------------------------------------------------------------


def test_compiled_step_runs_eagerly_and_matches():
    torch._dynamo.reset()
    model, twin = _model(), _model()
    opt, ref = FlashAdamW(model.parameters(), lr=1e-2), FlashAdamW(twin.parameters(), lr=1e-2)
    compiled = torch.compile(opt.step)
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(1))  # torch's hook wrapper still runs
    for seed in range(2):
        _backward(model, seed)
        _backward(twin, seed)
        compiled()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert len(seen) == 2
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_compiled_step_with_fullgraph_says_why_and_changes_nothing():
    torch._dynamo.reset()
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _backward(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Exception, match="flashdist: the optimizer step runs eagerly") as info:
        torch.compile(opt.step, fullgraph=True)()
    assert not isinstance(info.value, RecursionError)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert float(opt.state[model[0].weight].get("step", 0)) == 0
    opt.step()  # eager still works
    assert float(opt.state[model[0].weight]["step"]) == 1


# ----- precision warning ----------------------------------------------------------------------------------


def test_fp32_parameters_warn_once_how_to_get_24_bit_masters(monkeypatch):
    monkeypatch.delitem(sys.modules, "peft", raising=False)  # (with PEFT loaded the advice is PEFT's)
    with pytest.warns(PrecisionWarning, match=r"model.to\(torch.bfloat16\).*docs/integrations.md") as record:
        opt = FlashAdamW(_model(dtype=torch.float32).parameters())
    assert len([w for w in record if w.category is PrecisionWarning]) == 1
    assert record[0].filename == __file__  # points at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4))]})  # said once


def test_with_peft_loaded_the_advice_says_to_keep_fp32_adapters(monkeypatch):
    """PEFT upcasts adapters again at load_adapter (a Trainer resume): a bf16 cast of adapters would lead into
    a run that cannot resume, so with PEFT loaded the advice says to keep adapters fp32 with
    master_weight_bits=None. The optimizer cannot tell adapters from a model trained in full (the Trainer
    imports PEFT whenever it is installed), so the advice for a model computing in bf16 follows it."""
    monkeypatch.setitem(sys.modules, "peft", types.ModuleType("peft"))
    with pytest.warns(PrecisionWarning, match=r"PEFT adapters.*load_adapter.*Otherwise: if the model computes in "
                      r"bf16.*model.to\(torch.bfloat16\).*master_weight_bits=None") as record:
        FlashAdamW(_model(dtype=torch.float32).parameters())
    assert "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        FlashAdamW(_model(dtype=torch.float32).parameters(), master_weight_bits=None)


@pytest.mark.parametrize("case", ["bf16", "fp32-with-master_weight_bits=None", "mixed-bf16-and-fp32"])
def test_no_precision_warning_without_the_sign(case):
    model = _model(dtype=torch.float32 if case.startswith("fp32") else torch.bfloat16)
    if case.startswith("mixed"):
        model[2].float()  # e.g. a head kept in fp32 on purpose
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        FlashAdamW(model.parameters(), master_weight_bits=None if "None" in case else 24)


def test_precision_warning_when_fp32_parameters_are_swapped_in():
    # Accelerate's FSDP2 with mixed precision upcasts a bf16 model's parameters to fp32 after the optimizer
    # was built on the bf16 ones
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        opt = FlashAdamW(model.parameters())
    upcast = copy.deepcopy(model).float()
    opt.param_groups[0]["params"] = list(upcast.parameters())
    with pytest.warns(PrecisionWarning, match="fp32 parameters"):
        _train(upcast, opt, 1)
    assert "rho" not in opt.state[upcast[0].weight]


def test_plain_1d_tensor_swapped_into_a_row_layout_group_is_refused():
    """DeepSpeed ZeRO swaps a group's parameters for one flat 1-d partition; in a row-layout group its
    moments would silently stay fp32, so the first step refuses it and names the fix."""
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    opt = FlashAdamW(model.parameters(), lr=1e-3)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).requires_grad_()
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]
    with pytest.raises(ValueError, match="plain 1-d tensor.*flat_layout=True"):
        opt.step()
    # a user's own 1-d nn.Parameter swapped in is an ordinary new parameter
    bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    bias.grad = torch.ones_like(bias)
    opt.param_groups[0]["params"] = [bias]
    opt.step()
    assert "exp_avg" in opt.state[bias] and bias.float().abs().sum() > 0
    # FlashMuon has no flat layout to advise: it needs whole matrices, which ZeRO's partitions are not
    muon = flashdist.FlashMuon([model.weight])
    muon.param_groups[0]["params"] = [flat]
    with pytest.raises(ValueError, match="plain 1-d tensor.*FlashMuon cannot run under DeepSpeed ZeRO") as refused:
        muon.step()
    assert "flat_layout=True" not in str(refused.value)


# ----- weights written outside the optimizer -----------------------------------------------------------------


def _write_outside(model, how: str, source) -> list[torch.nn.Parameter]:
    """Write new weights into ``model`` the way users and frameworks do; returns the parameters written."""
    if how == "load_state_dict":  # Trainer's load_best_model_at_end, a user's restore
        model.load_state_dict(source.state_dict())
        return list(model.parameters())
    if how == "swa-copy-back":  # torch.optim.swa_utils users: p_model.detach().copy_(p_swa)
        for p, q in zip(model.parameters(), source.parameters()):
            p.detach().copy_(q)
        return list(model.parameters())
    with torch.no_grad():  # torch.nn.init on one parameter
        torch.nn.init.normal_(model[0].weight, std=0.1)
    return [model[0].weight]


@pytest.mark.parametrize("how", ["load_state_dict", "swa-copy-back", "nn.init"])
def test_a_weight_written_outside_the_optimizer_is_its_own_master(how):
    # before: the next step and master_weight started from the new bf16 weights plus the old rho
    model, twin = _model(), _model()
    opt, ref = FlashAdamW(model.parameters(), lr=1e-2), FlashAdamW(twin.parameters(), lr=1e-2)
    _train(model, opt, 2)
    _train(twin, ref, 2)
    written = _write_outside(model, how, _model(seed=7))
    kept = [p for p in model.parameters() if not any(p is w for w in written)]
    for p in written:
        assert torch.equal(opt.master_weight(p), p.float())
    for p in kept:
        assert opt.state[p]["rho"].any() and not torch.equal(opt.master_weight(p), p.float())
    # the reference: the same weights, with the rho of the written parameters set to 0 by hand
    _write_outside(twin, how, _model(seed=7))
    for p, q in zip(model.parameters(), twin.parameters()):
        if any(p is w for w in written):
            ref.state[q]["rho"].zero_()
    _train(model, opt, 2, start=2)
    _train(twin, ref, 2, start=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]["rho"], ref.state[q]["rho"])


def test_a_state_dict_after_an_outside_write_saves_rho_0_and_a_normal_run_keeps_rho():
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    assert opt.adopt_outside_writes() == 0  # the optimizer's own writes are not outside ones
    assert all(opt.state[p]["rho"].any() for p in model.parameters())
    with torch.no_grad():
        model[2].bias.add_(1.0)
    sd = opt.state_dict()
    assert not sd["state"][3]["rho"].any() and sd["state"][0]["rho"].any()
    model[2].bias.data.add_(1.0)  # through .data: its own version counter, not seen (documented)
    assert opt.adopt_outside_writes() == 0


# ----- parameters cast after their state was made -----------------------------------------------------------

_CAST_OPTIMIZERS = {"adamw": lambda model, lr: FlashAdamW(model.parameters(), lr=lr),
                    "muon": lambda model, lr: flashdist.FlashMuon(flashdist.muon_param_groups(model), lr=lr)}


@pytest.mark.parametrize("kind", _CAST_OPTIMIZERS)
def test_a_model_cast_up_to_fp32_after_steps_keeps_its_exact_master_weights(kind):
    """bf16 weights with rho, then model.float(): the master weights (weight + rho) become the fp32 weights,
    exactly, both as master_weight reports them before the next step and as that step starts from."""
    model = _model()
    opt = _CAST_OPTIMIZERS[kind](model, 1e-2)
    _train(model, opt, 3)
    masters = [opt.master_weight(p) for p in model.parameters()]
    assert any(opt.state[p]["rho"].any() for p in model.parameters())
    model.float()
    assert all(torch.equal(opt.master_weight(p), m) for p, m in zip(model.parameters(), masters))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a step with zero gradients moves by the decay and the momentum only
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # nothing rounded: no warning
        opt.step()
    assert all("rho" not in opt.state[p] for p in model.parameters())
    assert all(not torch.equal(p, m) for p, m in zip(model.parameters(), masters) if p.ndim == 2)
    _train(model, opt, 1, start=3)


@pytest.mark.parametrize("between", ["state_dict", "clear_plans", "deepcopy", "another-subset-steps"])
def test_a_cast_up_is_exact_whatever_happens_before_the_next_step(between):
    """The dtype rho belongs to is kept with the optimizer (and its copies), not with a cached step plan: a
    state dict, dropped plans, a deepcopy or a step over another subset of parameters between the cast and the
    next step keep the exact master weights."""
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    masters = [opt.master_weight(p) for p in model.parameters()]
    model.float()
    if between == "state_dict":
        opt.state_dict()
    elif between == "clear_plans":
        opt.clear_plans()
    elif between == "deepcopy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)  # (the fp32-parameter advice, as at construction)
            model, opt = copy.deepcopy((model, opt))
    for group in opt.param_groups:
        group["lr"] = 0.0  # a step that changes no weight: the parameters then are the master weights
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # nothing rounded: no warning
        if between == "another-subset-steps":
            first = list(model.parameters())[:2]
            for p in first:
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(opt.master_weight(p), m) for p, m in zip(model.parameters(), masters))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))


@pytest.mark.parametrize("kind", _CAST_OPTIMIZERS)
def test_a_model_cast_down_after_steps_gets_master_weights_from_the_cast_values(kind):
    """fp32 weights stepped, then model.to(bf16): the next step adds rho (one PrecisionWarning says the cast
    values are the master weights from there), so updates far below a bf16 spacing still add up (before,
    they rounded away without a word)."""
    model, twin = _model(dtype=torch.float32), _model(dtype=torch.float32)  # the twin stays fp32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # (the fp32-model advice at construction)
        opt, ref = _CAST_OPTIMIZERS[kind](model, 1e-5), _CAST_OPTIMIZERS[kind](twin, 1e-5)
    _train(model, opt, 1)
    _train(twin, ref, 1)
    model.to(torch.bfloat16)
    start = [p.detach().float().clone() for p in model.parameters()]
    twin_start = [p.detach().clone() for p in twin.parameters()]
    with pytest.warns(PrecisionWarning, match="changed dtype after their optimizer state was made"):
        _train(model, opt, 1, start=1)
    _train(model, opt, 8, start=2)
    _train(twin, ref, 9, start=1)
    assert all("rho" in opt.state[p] for p in model.parameters())
    for p, q, s, t in zip(model.parameters(), twin.parameters(), start, twin_start):
        if p.ndim == 2:  # 9 updates far below a bf16 spacing: the master weights moved as the fp32 twin's did
            moved, fp32_moved = (opt.master_weight(p) - s).abs().mean(), (q - t).abs().mean()
            assert 0.7 < moved / fp32_moved < 1.3, (moved, fp32_moved)
            assert opt.state[p]["rho"].any()


def test_a_model_cast_between_bf16_and_fp16_after_steps_restarts_rho():
    """rho counts steps of the parameter's own spacing: after a cast between bf16 and fp16 it restarts at 0
    (the cast value is the master weight), with one PrecisionWarning, instead of being read in the wrong
    spacing."""
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    model.half()
    assert all(torch.equal(opt.master_weight(p), p.float()) for p in model.parameters())
    with pytest.warns(PrecisionWarning, match="changed dtype"):
        _train(model, opt, 1, start=3)
    assert all(opt.state[p]["rho"].dtype == torch.int8 for p in model.parameters())


@pytest.mark.parametrize("kind", _CAST_OPTIMIZERS)
def test_storage_of_another_shape_swapped_in_after_a_step_is_refused_before_any_change(kind):
    """``p.data = t`` with ``t`` of another shape keeps the Parameter and its state: the next step refuses it in
    one line naming it (it failed inside the step with a size mismatch), changing nothing."""
    model = _model()
    opt = _CAST_OPTIMIZERS[kind](model, 1e-2)
    _train(model, opt, 1)
    weight = model[0].weight
    weight.data = torch.zeros(16, 32, dtype=weight.dtype)
    weight.grad = torch.ones_like(weight)
    others = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"shape \(16, 32\).*has state '.*' of shape \(64, 32\), made for another"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), others))


_TWO_GROUPS = {"adamw": lambda model, lr: FlashAdamW([{"params": model[0].parameters()},
                                                      {"params": model[2].parameters()}], lr=lr),
               "sgd": lambda model, lr: FlashSGD([{"params": model[0].parameters()},
                                                  {"params": model[2].parameters()}], lr=lr, momentum=0.9),
               "muon": lambda model, lr: flashdist.FlashMuon([{"params": [model[0].weight]},
                                                              {"params": [model[2].weight]},
                                                              {"params": [model[0].bias, model[2].bias],
                                                               "use_muon": False}], lr=lr)}


@pytest.mark.parametrize("change", ["put-into-list", "p.data-of-another-shape"])
@pytest.mark.parametrize("kind", _TWO_GROUPS)
def test_a_change_refused_in_a_later_group_steps_no_earlier_group(kind, change):
    """The step makes every group's plan, with the checks a parameter changed in place meets, before any group
    steps: a parameter of another dtype put into a later group's list (the same list, the same length), or its
    storage swapped for one of another shape, is refused with the earlier groups' weights and state as they
    were (they stepped, and a retry after the fix stepped them twice)."""
    model = _model()
    opt = _TWO_GROUPS[kind](model, 1e-2)
    _train(model, opt, 1)
    last = opt.param_groups[-2 if kind == "muon" else -1]
    _backward(model, 1)
    if change == "put-into-list":
        bad = last["params"][0] = torch.nn.Parameter(torch.zeros(8, 64, dtype=torch.float64))
        match = "float64"
    else:
        bad = last["params"][0]
        bad.data = torch.zeros(16, 64, dtype=bad.dtype)
        match = r"shape \(16, 64\).*made for another"
    bad.grad = torch.ones_like(bad)
    earlier = [p for group in opt.param_groups if group is not last for p in group["params"]]
    weights, state = [p.detach().clone() for p in earlier], _state_bits(opt, earlier)
    with pytest.raises((TypeError, ValueError), match=match):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(earlier, weights))
    assert all(torch.equal(s[k], v) for p, s in zip(earlier, state) for k, v in opt.state[p].items())
