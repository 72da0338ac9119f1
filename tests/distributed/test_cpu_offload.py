"""FSDP2 with ``CPUOffloadPolicy``: parameters, gradients and optimizer state in host memory, the step on the
CPU. On a GPU machine FSDP2 keeps each local shard in (pinned) host memory while the mesh is CUDA; on this
CPU-only machine ``CPUOffloadPolicy(pin_memory=False)`` runs FSDP2's offload code paths on a CPU mesh
(``pin_memory=True``, the default, needs an accelerator: torch refuses it in ``fully_shard``). Both layouts
are checked against the single-process step bit for bit, with DCP save/load across world sizes and
gradient release."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from sharding_cases import (assert_bitwise_equal, check_state_layout, global_grads, make_mixed_net, make_optimizer,
                            set_grads, single_threaded, snapshot, stepped_state)

import flashdist
from flashdist import checkpoint
from flashdist import distributed as D

pytestmark = pytest.mark.slow  # multi-process

STEPS = 4


def _shard_offloaded(model, mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    fully_shard(model.head, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def _offloaded_params(model) -> list[bool]:
    return [fsdp_param.offload_to_cpu for module in model.modules() if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups for fsdp_param in group.fsdp_params]


def _make_fused_optimizer(model):
    """The test configuration with the backend a user gets: "auto", the fused CPU step for host tensors."""
    optimizer = make_optimizer(model)
    for group in optimizer.param_groups:
        group["backend"] = "auto"
    return optimizer


@single_threaded
def _single_process() -> dict[str, torch.Tensor]:
    model = make_mixed_net()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        set_grads(model, global_grads(model, step))
        optimizer.step()
    return snapshot(model, optimizer)


def _loss(model, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return model(torch.randn(8, 40, generator=gen).to(torch.bfloat16)).float().pow(2).mean()


def _offload_rank(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}

    # 1. the same global gradients: the step is the single-process step, bit for bit
    model = _shard_offloaded(make_mixed_net(), mesh)
    assert all(_offloaded_params(model)) and _offloaded_params(model)
    optimizer = _make_fused_optimizer(model)
    for step in range(STEPS):
        set_grads(model, global_grads(model, step))
        optimizer.step()
    check_state_layout(model, optimizer)
    for p in model.parameters():
        assert D.local(p).device.type == "cpu"
        assert all(D.local(v).device.type == "cpu" for v in optimizer.state.get(p, {}).values()
                   if torch.is_tensor(v))
    out["injected"] = snapshot(model, optimizer)

    # 2. real backward passes: offloaded = not offloaded, and gradient release = the ordinary step
    runs = {}
    for label, offload, release in (("plain", False, False), ("offload", True, False),
                                    ("offload+release", True, True)):
        from torch.distributed.fsdp import fully_shard

        model = make_mixed_net()
        if offload:
            _shard_offloaded(model, mesh)
        else:
            fully_shard(model.head, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = _make_fused_optimizer(model)
        handle = flashdist.enable_gradient_release(model, optimizer) if release else None
        for step in range(STEPS):
            _loss(model, step, rank).backward()
            if release:
                assert all(p.grad is None for p in model.parameters()), "release left a gradient behind"
            optimizer.step()
            optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        runs[label] = snapshot(model, optimizer)
        if label == "offload":
            checkpoint.save(path, model, optimizer, extra={"step": STEPS})
    out["runs"] = runs

    # 3. a DCP checkpoint of the offloaded run loads into offloaded FSDP2 on this world size
    model = _shard_offloaded(make_mixed_net(), mesh)
    optimizer = _make_fused_optimizer(model)
    assert checkpoint.load(path, model, optimizer)["step"] == STEPS
    out["loaded"] = snapshot(model, optimizer)
    return out if rank == 0 else None


def _load_rank(rank: int, world_size: int, path: str) -> dict:
    """The checkpoint saved by 2 offloaded ranks, loaded by ``world_size`` ranks without offload."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_mixed_net()
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = _make_fused_optimizer(model)
    checkpoint.load(path, model, optimizer)
    loaded = snapshot(model, optimizer)  # a collective: every rank gathers
    return loaded if rank == 0 else None


def test_fsdp2_cpu_offload_policy_steps_like_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    result = run_ranks(_offload_rank, 2, path, timeout=300)[0]
    assert_bitwise_equal(result["injected"], _single_process(), "CPUOffloadPolicy vs one process")
    runs = result["runs"]
    assert_bitwise_equal(runs["offload"], runs["plain"], "CPUOffloadPolicy vs no offload")
    assert_bitwise_equal(runs["offload+release"], runs["offload"], "gradient release under CPUOffloadPolicy")
    assert_bitwise_equal(result["loaded"], runs["offload"], "DCP load, same world size")
    resharded = run_ranks(_load_rank, 3, path, timeout=300)[0]
    assert_bitwise_equal(resharded, runs["offload"], "DCP load, 2 offloaded ranks -> 3 ranks")


# ----- the layout FSDP2's CPUOffloadPolicy gives on a GPU machine ------------------------------------------
#
# There each parameter is a DTensor on a CUDA mesh whose local shard lives in host memory (FSDP2 builds it
# with the DTensor constructor, not from_local, which would move it to the mesh's device). The optimizer
# sees only that layout, so it can be built here: a "cuda" mesh without a backend (no CUDA call is made),
# host shards, and the same calls FSDP2 makes.


def _host_dtensor(full: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    pieces = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_coordinate()[0]
    local = pieces[rank].clone() if rank < len(pieces) else full[:0].clone()
    stride = torch.empty(full.shape, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(full.shape, stride, full.dtype))
    return DTensor(local, spec, requires_grad=False)


def _cuda_mesh_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cuda", torch.arange(world_size), _init_backend=False)
    model = make_mixed_net()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(_host_dtensor(p.data, mesh), requires_grad=p.requires_grad))
    optimizer = _make_fused_optimizer(model)
    portable = None
    for step in range(STEPS):
        grads = global_grads(model, step)
        for name, p in model.named_parameters():
            g = grads.get(name)
            p.grad = None if g is None else _host_dtensor(g, mesh)
        optimizer.step()
        if step == 1:
            portable = optimizer.state_dict()  # dequantized moments: DTensors of host tensors too
    check_state_layout(model, optimizer)
    for p in model.parameters():
        for key, value in optimizer.state.get(p, {}).items():
            assert D.local(value).device.type == "cpu", f"{key} left host memory"
    for entry in portable["state"].values():
        for key, value in entry.items():
            assert not torch.is_tensor(value) or D.local(value).device.type == "cpu", key
    local = {}
    for name, p in model.named_parameters():
        local[name] = D.local(p).clone()
        local[f"{name}/master"] = D.local(optimizer.master_weight(p)).clone()
        for key, value in stepped_state(optimizer, p).items():
            local[f"{name}/{key}"] = D.local(value).clone()
    return {"local": local, "rank": rank}


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"{n}ranks")
def test_host_shards_on_a_cuda_mesh_keep_state_on_the_host(world_size):
    """The step on host shards of a CUDA mesh: state created beside the parameter (not moved to the mesh's
    device), DTensor state with the parameter's mesh and global shape, and every local tensor equal bit for
    bit to the rows of the single-process step."""
    want = _single_process()
    for result in run_ranks(_cuda_mesh_rank, world_size, timeout=300):
        for key, got in result["local"].items():
            full = want[key]
            if key.endswith("/step"):
                assert torch.equal(got, full), key
                continue
            pieces = torch.chunk(full, world_size, dim=0)
            rows = pieces[result["rank"]] if result["rank"] < len(pieces) else full[:0]
            assert_bitwise_equal({key: got}, {key: rows.contiguous()}, f"rank {result['rank']}")
