"""Under FSDP2 on 2 gloo ranks: the optimizer's record of its parameters' version counters sees no write in a
normal run (FSDP2's all-gather reads the sharded parameters, its reshard frees the unsharded ones: neither
moves the sharded local tensor's counter), a model.load_state_dict is seen on every rank, and an optimizer
built on the unsharded model holds nothing of it once the parameters are swapped for their shards."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.slow  # multi-process


def _ranks(rank: int, world_size: int) -> dict:
    import gc
    import weakref

    from torch.distributed.fsdp import fully_shard

    import flashdist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    opt = flashdist.FlashAdamW(model.parameters(), lr=1e-2)  # built on the unsharded model (Accelerate's order)
    unsharded = weakref.ref(model[0].weight)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt.param_groups[0]["params"] = list(model.parameters())  # the swap Accelerate's prepare makes
    gc.collect()
    out = {"unsharded_freed": unsharded() is None, "state_before_step": len(opt.state), "resets_in_run": 0}
    torch.manual_seed(1 + rank)
    for _ in range(3):
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
        out["resets_in_run"] += opt.adopt_outside_writes()  # after FSDP2's all-gathers, reshards, reduce-scatters
        opt.step()
        opt.zero_grad()
    out["rho_nonzero"] = sum(int(D_local(opt.state[p]["rho"]).any()) for p in model.parameters())
    model.load_state_dict(model.state_dict())  # a restore (the Trainer's load_best_model_at_end)
    out["resets_after_load"] = opt.adopt_outside_writes()
    return out


def D_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_fsdp2_run_keeps_rho_and_a_model_load_resets_it():
    for rank, got in enumerate(run_ranks(_ranks, 2, timeout=120.0)):
        assert got["unsharded_freed"] and got["state_before_step"] == 0, (rank, got)
        assert got["resets_in_run"] == 0, f"rank {rank}: FSDP2's own writes were taken as outside writes: {got}"
        assert got["rho_nonzero"] == 4 and got["resets_after_load"] == 4, (rank, got)
