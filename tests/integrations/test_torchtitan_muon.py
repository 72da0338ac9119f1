"""FlashMuon by name in torchtitan's optimizer container: one FlashMuon holds the Muon matrices and the
``use_muon=False`` groups, and a step through the container equals FlashMuon's own, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan integration is tested against torchtitan itself")

from test_torchtitan import _model  # noqa: E402
from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from flashdist import FlashMuon  # noqa: E402
from flashdist.integrations.torchtitan import FlashOptimizersContainer  # noqa: E402


def test_container_builds_flash_muon_with_adamw_groups():
    model, twin = _model(), _model()
    config = FlashOptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"bias|^norm$", optimizer_name="FlashMuon",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0, "use_muon": False}),
        ParamGroupConfig(pattern=r".*", optimizer_name="FlashMuon", optimizer_kwargs={"lr": 0.02}),
    ])
    container = config.build(model_parts=[model])
    (muon,) = list(container)
    assert isinstance(muon, FlashMuon) and [g["use_muon"] for g in muon.param_groups] == [False, True]
    own = FlashMuon([{"params": [twin.proj.bias, twin.out.bias, twin.norm], "lr": 1e-2, "weight_decay": 0.0,
                      "use_muon": False}, {"params": [twin.proj.weight, twin.out.weight], "lr": 0.02}])
    for step in range(2):
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
            q.grad = p.grad.clone()
        container.step()
        own.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_flash_muon_helper_orthogonalizes_grouped_experts_one_by_one():
    """The FlashMuon helper's Muon group stacks weights of more than 2 dims (torchtitan's GroupedExperts
    ``(experts, out, in)``): each expert's matrix orthogonalized on its own, as separate matrices would be."""
    from flashdist.integrations.torchtitan import flash_muon

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1_EFD = torch.nn.Parameter(torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(0)))

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts, self.norm = Experts(), torch.nn.Parameter(torch.ones(8))

    model = Moe().bfloat16()
    parts = [torch.nn.Parameter(m.detach().clone()) for m in model.experts.w1_EFD]
    (muon,) = list(flash_muon(lr=0.02, quantize_states=False).build(model_parts=[model]))
    own = FlashMuon(parts, lr=0.02, weight_decay=0.1, quantize_states=False)
    for step in range(2):
        g = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(10 + step)).bfloat16()
        model.experts.w1_EFD.grad, model.norm.grad = g, torch.zeros_like(model.norm)
        for part, m in zip(parts, g):
            part.grad = m.clone()
        muon.step()
        own.step()
    assert [g.get("flatten") for g in muon.param_groups if g["use_muon"]] == [False]
    assert torch.equal(model.experts.w1_EFD.detach(), torch.stack([p.detach() for p in parts]))


def test_flash_muon_helper_gives_unforeseen_vectors_the_adamw_update():
    """A 1-d parameter that no name pattern foresaw (gpt_oss's attention sinks) and the Muon group's pattern
    matched takes the AdamW group's update, as muon_param_groups would group it, instead of failing the build;
    a config without an AdamW group still refuses it, naming it."""
    from flashdist.integrations.torchtitan import flash_muon

    model = torch.nn.Module()
    model.wq = torch.nn.Linear(8, 8, bias=False)
    model.norm = torch.nn.Parameter(torch.ones(8))
    model.sinks = torch.nn.Parameter(torch.zeros(4))
    (muon,) = list(flash_muon().build(model_parts=[model.bfloat16()]))
    groups = [(g["use_muon"], g["param_names"]) for g in muon.param_groups]
    assert groups == [(False, ["norm", "sinks"]), (True, ["wq.weight"])]
    only_muon = FlashOptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="FlashMuon", optimizer_kwargs={"lr": 0.02})])
    with pytest.raises(ValueError, match="norm.*fewer than 2 dims"):
        only_muon.build(model_parts=[model])
