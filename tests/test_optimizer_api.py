"""The documented optimizer API that checkpointing, gradient release and integrations build on, in one
process: ensure_state, step_parameters, check_group, clear_plans, layout_options, state_dict(format=) and
its override, keeps_step_count, LayoutOptions and the one master_weight_bits check."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import flashdist
from flashdist import FlashAdamW, FlashLion, FlashSGD, checkpoint
from flashdist.checkpoint.dcp import CheckpointError, optimizer_state_dict
from flashdist.optim.layout import MASTER_WEIGHT_BITS, LayoutOptions, check_master_weight_bits

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(torch.bfloat16)


def _backward(model, seed: int = 0) -> None:
    torch.manual_seed(seed)
    (model(X).float() * torch.randn(8, 3)).sum().backward()


def _state(opt, p) -> dict:
    return {k: v.clone() for k, v in opt.state[p].items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----- ensure_state ---------------------------------------------------------------------------------------


def test_ensure_state_creates_the_layouts_state_and_is_a_no_op_when_complete():
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    frozen = model[0].weight
    assert frozen not in opt.state  # frozen parameters hold no state until asked for
    opt.ensure_state(frozen)
    made = opt.state[frozen]
    assert {k: v.dtype for k, v in made.items()} == {
        "step": torch.float32, "exp_avg_codes": torch.int8, "exp_avg_scales": torch.bfloat16,
        "exp_avg_sq_codes": torch.uint8, "exp_avg_sq_scales": torch.bfloat16, "rho": torch.int8}
    assert made["exp_avg_codes"].shape == frozen.shape and made["exp_avg_scales"].shape == (40, 1)
    before = {k: id(v) for k, v in made.items()}
    opt.ensure_state(frozen, opt.param_groups[0])
    assert {k: id(v) for k, v in opt.state[frozen].items()} == before


def test_ensure_state_adopts_float_moments_written_into_the_state():
    """A loader that writes float moments straight into ``optimizer.state`` (DeepSpeed's universal
    checkpoints): ensure_state quantizes them into the codes, as loading them through load_state_dict does."""
    model, ref_model = _model(), _model()
    opt, ref = FlashAdamW(model.parameters()), FlashAdamW(ref_model.parameters())
    _backward(model)
    _backward(ref_model)
    opt.step()
    ref.step()
    p, q = model[0].weight, ref_model[0].weight
    portable = ref.state_dict()["state"][0]
    state = opt.state[p]
    for name in ("exp_avg", "exp_avg_sq"):
        del state[f"{name}_codes"], state[f"{name}_scales"]
        state[name] = portable[name].clone()
    state["step"] = 1  # a plain number, as such a loader writes it
    opt.ensure_state(p)
    _assert_same_state(_state(opt, p), _state(ref, q))
    # and the optimizer steps on from there exactly as the untouched one
    _backward(model, 1)
    _backward(ref_model, 1)
    opt.step()
    ref.step()
    _assert_same_state(_state(opt, p), _state(ref, q))


def test_ensure_state_refuses_a_group_of_another_optimizer():
    model = _model()
    opt = FlashAdamW(model.parameters())
    with pytest.raises(ValueError, match="ensure_state takes one of this optimizer's param_groups"):
        opt.ensure_state(model[0].weight, dict(opt.param_groups[0]))
    with pytest.raises(KeyError, match="not a parameter of the optimizer"):
        opt.ensure_state(torch.nn.Parameter(torch.zeros(2, 2)))


# ----- step_parameters, check_group, clear_plans --------------------------------------------------------


@pytest.mark.parametrize("cls", [FlashAdamW, FlashLion, FlashSGD], ids=lambda c: c.__name__)
def test_step_parameters_steps_the_given_parameters_as_step_does(cls):
    kwargs = {"momentum": 0.9} if cls is FlashSGD else {}
    model, ref_model = _model(), _model()
    opt, ref = cls(model.parameters(), lr=1e-2, **kwargs), cls(ref_model.parameters(), lr=1e-2, **kwargs)
    for step in range(3):
        _backward(model, step)
        _backward(ref_model, step)
        chosen = [model[2].weight, model[0].bias]
        opt.step_parameters(opt.param_groups[0], chosen)
        # the reference: an ordinary step with only those parameters holding a gradient
        ref_model[0].weight.grad = ref_model[2].bias.grad = None
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), (step, name)
            if p in opt.state and q in ref.state:
                _assert_same_state(_state(opt, p), _state(ref, q))
        assert model[0].weight.grad is not None  # not stepped, not cleared
        opt.zero_grad()
        ref.zero_grad()


def test_step_parameters_refuses_a_group_of_another_optimizer():
    model = _model()
    opt = FlashAdamW(model.parameters())
    _backward(model)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="step_parameters takes one of this optimizer's param_groups"):
        opt.step_parameters(dict(opt.param_groups[0]), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_step_parameters_refuses_a_parameter_without_a_gradient_and_changes_nothing():
    model = _model()
    opt = FlashAdamW(model.parameters())
    _backward(model)
    model[2].bias.grad = None
    before = {i: {"param": p.clone(), **_state(opt, p)} for i, p in enumerate(model.parameters())}
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(3,\)\) without a gradient"):
        opt.step_parameters(opt.param_groups[0], [model[2].weight, model[2].bias])
    for i, p in enumerate(model.parameters()):
        _assert_same_state(before[i], {"param": p.clone(), **_state(opt, p)})


def test_check_group_names_the_bad_hyperparameter_or_changed_layout_and_changes_nothing():
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    group = opt.param_groups[0]
    opt.check_group(group)
    with pytest.raises(ValueError, match=r"^flashdist: eps must be >= 0.0, got -1.0$"):
        opt.check_group({**group, "eps": -1.0})
    with pytest.raises(ValueError, match=r"^flashdist: lr must be a finite"):
        opt.check_group({**group, "lr": float("nan")})
    assert group["lr"] == 1e-2 and group["eps"] == 1e-8
    group["companded"] = False
    with pytest.raises(ValueError, match=r"companded: True -> False"):
        opt.check_group(group)
    group["companded"] = True
    opt.check_group(group)


def test_clear_plans_makes_the_next_step_use_a_state_tensor_replaced_by_hand():
    model, ref_model = _model(), _model()
    opt, ref = FlashAdamW(model.parameters()), FlashAdamW(ref_model.parameters())
    for m, o in ((model, opt), (ref_model, ref)):
        _backward(m)
        o.step()
    p = model[0].weight
    replaced = opt.state[p]["exp_avg_codes"] = opt.state[p]["exp_avg_codes"].clone()
    before = replaced.clone()
    opt.clear_plans()
    for m, o in ((model, opt), (ref_model, ref)):
        _backward(m, 1)
        o.step()
    assert not torch.equal(replaced, before)  # the new tensor was stepped
    _assert_same_state(_state(opt, p), _state(ref, ref_model[0].weight))


# ----- layout options ------------------------------------------------------------------------------------


def test_layout_options_are_one_frozen_validated_value_per_group():
    model = _model()
    opt = FlashAdamW([{"params": [model[0].weight]}, {"params": [model[2].weight], "companded": False}],
                     master_weight_bits=32)
    first, second = (opt.layout_options(g) for g in opt.param_groups)
    assert first == LayoutOptions(master_weight_bits=32)
    assert second == dataclasses.replace(first, companded=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.companded = False
    # the group dict keeps its keys (torch's contract); changing one does not change the recorded options
    opt.param_groups[1]["quantize_states"] = False
    assert opt.layout_options(opt.param_groups[1]) == second
    with pytest.raises(KeyError, match="layout_options takes one of this optimizer's param_groups"):
        opt.layout_options({"params": []})


@pytest.mark.parametrize("field,value", [("master_weight_bits", 16), ("master_weight_bits", "24"),
                                         ("quantize_states", 1), ("companded", None), ("flat_layout", "no")])
def test_layout_options_refuse_a_bad_value_naming_the_option(field, value):
    with pytest.raises(ValueError, match=rf"^flashdist: {field} must be"):
        LayoutOptions(**{field: value})
    # the optimizer validates through it, before anything changes
    model = _model()
    opt = FlashAdamW([model[0].weight])
    with pytest.raises(ValueError, match=rf"^flashdist: {field} must be"):
        opt.add_param_group({"params": [model[2].weight], field: value})
    assert len(opt.param_groups) == 1 and model[2].weight not in opt.state


def test_master_weight_bits_is_checked_in_one_place():
    assert MASTER_WEIGHT_BITS == (*flashdist.quant.RHO_DTYPES, None)
    for bits in MASTER_WEIGHT_BITS:
        assert check_master_weight_bits(bits) is bits
    with pytest.raises(CheckpointError, match=r"^flashdist: master_weight_bits must be 24 or 32, got None$"):
        check_master_weight_bits(None, allow_none=False, error=CheckpointError)
    with pytest.raises(ValueError, match=r"^flashdist: bits must be 24, 32 or None, got 8$"):
        check_master_weight_bits(8, name="bits")


def test_importers_use_the_one_master_weight_bits_check():
    from flashdist.checkpoint.flashoptim_import import read_flashoptim

    group = {"params": [], "master_bytewidth": 3, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(CheckpointError, match=r"^flashdist: master_weight_bits must be 24, 32 or None, got 16$"):
        read_flashoptim({"state": {}, "param_groups": [group]}, model_state={}, master_weight_bits=16)


# ----- state dict formats ---------------------------------------------------------------------------------


def _state_keys(sd: dict) -> set[str]:
    return {k for entry in sd["state"].values() for k in entry}


def test_state_dict_in_a_given_format_leaves_the_setting_alone():
    model = _model()
    opt = FlashAdamW(model.parameters())
    _backward(model)
    opt.step()
    compressed = copy.deepcopy(opt.state_dict(format="compressed"))  # (it holds the live tensors, as torch's)
    assert opt.state_dict_format == "portable"
    assert {"exp_avg_codes", "exp_avg_sq_scales", "rho"} <= _state_keys(compressed)
    assert "exp_avg" in _state_keys(opt.state_dict())
    assert {g["flashdist_format"] for g in compressed["param_groups"]} == {"compressed"}
    # a state dict in either format loads back to the same state
    other = copy.deepcopy(opt)
    _backward(model, 1)
    opt.step()
    opt.load_state_dict(compressed)
    for p, q in zip(opt.state, other.state):
        _assert_same_state(_state(opt, p), _state(other, q))
    with pytest.raises(ValueError, match=r"^flashdist: state_dict's format must be one of"):
        opt.state_dict(format="fp32")


def test_format_override_holds_for_this_optimizer_and_this_thread_only():
    model, other_model = _model(), _model(1)
    opt, other = FlashAdamW(model.parameters()), FlashAdamW(other_model.parameters())
    seen = {}

    def from_thread():
        seen["thread"] = _state_keys(opt.state_dict())

    with opt.state_dict_format_override("compressed"):
        assert opt.state_dict_format == "portable"
        assert "exp_avg_codes" in _state_keys(opt.state_dict())
        assert "exp_avg" in _state_keys(opt.state_dict(format="portable"))  # an explicit format wins
        assert "exp_avg" in _state_keys(other.state_dict())
        # torch.distributed.checkpoint's helper calls state_dict() without arguments
        assert "exp_avg_codes" in _state_keys(get_optimizer_state_dict(model, opt))
        worker = threading.Thread(target=from_thread)
        worker.start()
        worker.join()
    assert "exp_avg" in seen["thread"] and "exp_avg_codes" not in seen["thread"]
    assert "exp_avg" in _state_keys(opt.state_dict())
    with pytest.raises(ValueError, match="state_dict_format_override's format must be one of"):
        opt.state_dict_format_override("fp8").__enter__()


def test_optimizer_state_dict_of_the_checkpoint_layer_takes_a_format():
    model = _model()
    opt = FlashAdamW(model.parameters())
    by_fqn = optimizer_state_dict(model, opt, format="compressed")
    assert set(by_fqn["state"]) == {n for n, _ in model.named_parameters()}
    assert "exp_avg_codes" in _state_keys(by_fqn) and opt.state_dict_format == "portable"
    assert "exp_avg" in _state_keys(optimizer_state_dict(model, opt))
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="format applies to flashdist optimizers"):
        optimizer_state_dict(model, plain, format="compressed")


def test_loading_a_compressed_checkpoint_never_changes_the_optimizers_format(tmp_path):
    """checkpoint.load reads the optimizer state in the format it was saved in; the live optimizer's
    ``state_dict_format`` (which a state_dict pre-hook sees, as would another thread) stays the user's."""
    model = _model()
    saver = FlashAdamW(model.parameters(), state_dict_format="compressed")
    _backward(model)
    saver.step()
    checkpoint.save(tmp_path / "ck", model, saver)
    loaded_model = _model(2)
    opt = FlashAdamW(loaded_model.parameters())
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(o.state_dict_format))
    checkpoint.load(tmp_path / "ck", loaded_model, opt)
    assert seen and set(seen) == {"portable"}
    for p, q in zip(saver.state, opt.state):
        _assert_same_state(_state(saver, p), _state(opt, q))


# ----- keeps_step_count -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls,torch_cls,kwargs", [(FlashAdamW, torch.optim.AdamW, {}),
                                                  (FlashSGD, torch.optim.SGD, {"momentum": 0.9})],
                         ids=["adamw", "sgd"])
def test_keeps_step_count_says_whether_the_torch_optimizer_keeps_step(cls, torch_cls, kwargs):
    p = torch.nn.Parameter(torch.randn(4, 32))
    torch_opt = torch_cls([p], lr=0.1, **kwargs)
    p.grad = torch.randn(4, 32)
    torch_opt.step()
    assert cls.keeps_step_count == ("step" in torch_opt.state[p])
    # so a state dict of that torch optimizer loads, and counts as the steps it holds
    q = torch.nn.Parameter(p.detach().clone())
    opt = cls([q], lr=0.1, master_weight_bits=None, **kwargs)
    opt.load_state_dict(torch_opt.state_dict())
    assert float(opt.state[q]["step"]) == 1.0
