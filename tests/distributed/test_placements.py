"""Placements flashdist cannot honour exactly (a shard that cuts a quantization group, Partial) are refused
when the optimizer is built, naming the parameter, its placement and the fix; the accepted ones (Shard(0),
Replicate, strided dim-0 shards, tensor-parallel column shards) build. A gradient whose placements differ
from its parameter's is refused by step(). tests/distributed/test_tensor_parallel.py covers 2-D meshes."""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.slow  # multi-process


def _build_error(model) -> str:
    from flashdist import FlashAdamW

    try:
        FlashAdamW(model.named_parameters(), backend="reference")
    except ValueError as e:
        return str(e)
    return ""


def _placements(rank: int, world_size: int) -> dict[str, str]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world_size,))
    errors = {}

    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)).to(torch.bfloat16)
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.shape == (4, 6) else None)
    errors["fsdp2-shard1"] = _build_error(model)

    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)).to(torch.bfloat16)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    errors["tp-rowwise"] = _build_error(model)

    model = nn.Sequential(nn.Linear(8, 6)).to(torch.bfloat16)
    parallelize_module(model, mesh, {"0": ColwiseParallel()})  # weight and bias Shard(0): whole rows
    errors["tp-colwise"] = _build_error(model)

    for label, placement in (("partial", Partial()), ("strided", _StridedShard(0, split_factor=2))):
        local = torch.zeros(4, 3, dtype=torch.bfloat16)
        model = nn.Module()
        model.weight = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))
        errors[label] = _build_error(model)

    # a gradient in another layout than its parameter (a Partial sum left by tensor parallelism)
    from flashdist import FlashAdamW

    model = nn.Module()
    model.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 3, dtype=torch.bfloat16), mesh, [Replicate()]))
    optimizer = FlashAdamW(model.named_parameters(), backend="reference")
    model.weight.grad = DTensor.from_local(torch.ones(4, 3, dtype=torch.bfloat16), mesh, [Partial()])
    try:
        optimizer.step()
    except RuntimeError as e:
        errors["partial-grad"] = str(e)
    assert not model.weight.to_local().any(), "a refused step changed the parameter"
    return errors


def test_refuses_placements_that_cut_groups():
    errors = run_ranks(_placements, 2)[0]
    # rows of 6 values in pieces of 3 on 2 ranks: each piece cuts the row's one group
    assert "'1.weight'" in errors["fsdp2-shard1"] and "Shard(dim=1)" in errors["fsdp2-shard1"], errors
    assert "'1.weight'" in errors["tp-rowwise"] and "Shard(dim=1)" in errors["tp-rowwise"], errors
    for label in ("fsdp2-shard1", "tp-rowwise"):
        assert "cut quantization groups" in errors[label] and "n in [1]" in errors[label], errors[label]
    assert errors["tp-colwise"] == "", errors["tp-colwise"]
    assert errors["strided"] == "", errors["strided"]  # a strided shard of dim 0 still holds whole rows
    assert "'weight'" in errors["partial"] and "Partial" in errors["partial"], errors
    assert "is not a shard of the parameter's values" in errors["partial"], errors
    assert "'weight'" in errors["partial-grad"] and "Partial(sum)" in errors["partial-grad"], errors
