"""The sharding promise: with the same global gradients, a step on an FSDP2-sharded model is bit-identical
to the step on the whole tensors in one process, for every world size and for HSDP. Parameters, master
weights, rho, codes and scales are compared bit for bit after several steps."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from sharding_cases import (CONFIGS, NoCollectives, assert_bitwise_equal, check_state_layout, global_grads,
                            make_mixed_net, make_optimizer, set_grads, shard_mixed_net, single_threaded, snapshot)

pytestmark = pytest.mark.slow  # multi-process

STEPS = 4


def test_every_optimizer_class_is_sharded():
    """A new optimizer class of tests/cases.py gets a configuration in sharding_cases.CONFIGS too."""
    from tests.cases import OPTIMIZERS

    missing = {o.cls.__name__ for o in OPTIMIZERS.values()} - {c.opt.cls.__name__ for c in CONFIGS.values()}
    assert not missing, f"add a configuration of {sorted(missing)} to CONFIGS in tests/distributed/sharding_cases.py"


@single_threaded
def single_process(config: str) -> tuple[dict[str, torch.Tensor], int]:
    model = make_mixed_net()
    optimizer = make_optimizer(model, config)
    for step in range(STEPS):
        set_grads(model, global_grads(model, step))
        optimizer.step()
    return snapshot(model, optimizer), int(optimizer.skipped)


def _sharded_run(rank: int, world_size: int, mesh_shape: tuple[int, ...], configs: tuple[str, ...]):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    out = {}
    for config in configs:
        model = shard_mixed_net(make_mixed_net(), mesh)
        optimizer = make_optimizer(model, config)
        assert len(optimizer.state) == 0  # none before the first step, as torch.optim
        for step in range(STEPS):
            set_grads(model, global_grads(model, step))
            with NoCollectives() as seen:
                optimizer.step()
            if CONFIGS[config].opt.elementwise:  # (FlashMuon gathers each matrix to its owner rank)
                assert not seen.collectives, f"step() issued collectives: {seen.collectives}"
            assert not seen.dtensor_ops, f"step() computed on DTensors, not local shards: {seen.dtensor_ops}"
        check_state_layout(model, optimizer)
        skipped = optimizer.skipped.clone()
        dist.all_reduce(skipped, group=mesh.get_group("shard"))  # each rank counts the groups of its rows
        out[config] = (snapshot(model, optimizer), int(skipped))
    return out if rank == 0 else None


def _compare(results: dict, label: str) -> None:
    for config, (got, skipped) in results.items():
        want, want_skipped = single_process(config)
        assert_bitwise_equal(got, want, f"{label}, {config}")
        assert skipped == want_skipped > 0, f"{label}, {config}: skipped groups {skipped} vs {want_skipped}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda n: f"{n}ranks")
def test_fsdp2_step_is_bit_identical_to_one_process(world_size):
    results = run_ranks(_sharded_run, world_size, (world_size,), tuple(CONFIGS))[0]
    _compare(results, f"FSDP2 on {world_size} ranks")


def test_hsdp_2x2_step_is_bit_identical_to_one_process():
    results = run_ranks(_sharded_run, 4, (2, 2), tuple(CONFIGS)[:1])[0]
    _compare(results, "HSDP (Replicate, Shard(0)) on a 2x2 mesh")
