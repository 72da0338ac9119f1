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
