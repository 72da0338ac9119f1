"""The promises every path through flashdist keeps (DESIGN.md decision 10), each written once as a check that
the conformance matrix (tests/conformance/test_matrix.py) runs on every cell:

- masters read from a checkpoint or an export equal the live ``param + rho`` bit for bit;
- a resumed run equals the uninterrupted one bit for bit (weights and optimizer state);
- before the first step the optimizer holds no more memory than torch.optim.AdamW (which holds none);
- state exists only for trainable parameters that are in ``param_groups``;
- a weight written outside the optimizer is its own master from then on;
- an option that does nothing says so, once.

Each check takes plain dicts or live objects and raises AssertionError naming the tensor and the cell."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from flashdist import distributed as D


def live_masters(model: torch.nn.Module, opt) -> dict[str, torch.Tensor]:
    """The fp32 master weight of every trainable parameter of ``model`` (its FQN -> full tensor): ``param +
    rho`` where the optimizer splits it, the parameter itself otherwise."""
    return {name: D.full_tensor(opt.master_weight(p)).float().clone()
            for name, p in model.named_parameters() if p.requires_grad}


def snapshot(model: torch.nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer state tensor of ``model``'s parameters, as full tensors keyed
    ``fqn`` and ``fqn:state_key``: what a resume must reproduce. The state of a parameter never stepped
    (step 0: the zero state a state dict makes, which a load does not keep) is the state its first step
    would make, and counts as none."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = D.full_tensor(p.detach()).clone()
        state = opt.state.get(p, {})
        if "step" in state and float(D.full_tensor(torch.as_tensor(state["step"]))) == 0:
            continue
        for key, value in state.items():
            out[f"{name}:{key}"] = D.full_tensor(torch.as_tensor(value)).clone()
    return out


def assert_bitwise_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    """Same keys, and for each the same dtype and bits (NaN equal to NaN)."""
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    assert not missing and not extra, f"{what}: missing {missing[:5]}, unexpected {extra[:5]}"
    for key, want in expected.items():
        have = got[key]
        assert have.dtype == want.dtype and have.shape == want.shape, \
            f"{what}: {key} is {have.dtype}{tuple(have.shape)}, expected {want.dtype}{tuple(want.shape)}"
        assert torch.equal(have.view(-1).view(torch.uint8) if have.numel() else have,
                           want.view(-1).view(torch.uint8) if want.numel() else want), \
            f"{what}: {key} differs (max |diff| {(have.double() - want.double()).abs().max().item():.3g})"


def assert_masters_from(source: str, masters: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
    """Masters read from a checkpoint or an export (``source`` names it) equal the live ``param + rho``."""
    assert_bitwise_equal(live, {k: masters[k].float() for k in live if k in masters}, f"masters from {source}")


def assert_resume_exact(uninterrupted: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor],
                        what: str) -> None:
    """A resumed run equals the run that never stopped, weights and state, bit for bit."""
    assert_bitwise_equal(uninterrupted, resumed, f"{what}: resumed vs uninterrupted")


def state_bytes(opt) -> int:
    """Bytes of every tensor the optimizer holds in ``state`` (local shards)."""
    return sum(D.local(v).numel() * D.local(v).element_size()
               for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def assert_memory_before_first_step_within_adamw(opt, model: torch.nn.Module) -> None:
    """Before the first step the optimizer holds no more than torch.optim.AdamW on the same parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = state_bytes(torch.optim.AdamW(params)) if params else 0
    held = state_bytes(opt)
    assert held <= adamw, f"{type(opt).__name__} holds {held} bytes of state before the first step, AdamW {adamw}"


def assert_state_only_for_trainable(opt) -> None:
    """State exists only for parameters in ``param_groups`` that require a gradient."""
    trainable = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
    stray = [tuple(p.shape) for p in opt.state if id(p) not in trainable and opt.state[p]]
    assert not stray, f"{type(opt).__name__} holds state for {len(stray)} tensors that are not trainable " \
                      f"parameters of its param_groups (shapes {stray[:3]})"


def assert_outside_write_is_own_master(opt, p: torch.Tensor, value: torch.Tensor) -> None:
    """After ``p`` is written outside the optimizer (``value`` copied in, as SWA, load_state_dict or
    torch.nn.init do), its master weight is exactly the new weight, not the new weight plus the old rho."""
    with torch.no_grad():
        p.copy_(value)
    master = D.full_tensor(opt.master_weight(p)).float()
    want = D.full_tensor(p.detach()).float()
    assert torch.equal(master, want), \
        f"master weight after an outside write is {(master - want).abs().max().item():.3g} off the written weight"


def assert_noop_option_says_so_once(build: Callable[[], object], step: Callable[[object], None],
                                    option: str) -> None:
    """``build()`` makes an optimizer with ``option`` where it can have no effect; building it and stepping it
    twice warns exactly once, naming the option."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = build()
        step(opt)
        step(opt)
    said = [w for w in record if option in str(w.message)]
    assert len(said) == 1, f"{option} had no effect and was mentioned {len(said)} times: " \
                           f"{[str(w.message)[:80] for w in said]}"
