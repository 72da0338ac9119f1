"""Gradient release, in one process and under FSDP2: the same result as the ordinary step, gradients freed
during backward, remove() restoring ordinary steps, and the refusals (accumulation, GradScaler)."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks
from sharding_cases import assert_bitwise_equal, make_mixed_net, make_optimizer, shard_mixed_net, snapshot

import flashdist
from flashdist import enable_gradient_release

STEPS = 3


def _batch(step: int, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 40, generator=gen).to(torch.bfloat16)


def _loss(model, step: int, rank: int = 0) -> torch.Tensor:
    return model(_batch(step, rank)).float().pow(2).mean()


def _train(model, optimizer, *, release: bool, rank: int = 0, steps: int = STEPS) -> None:
    handle = enable_gradient_release(model, optimizer) if release else None
    for step in range(steps):
        _loss(model, step, rank).backward()
        if release:
            assert all(p.grad is None for p in model.parameters()), "release left a gradient behind"
        optimizer.step()
        optimizer.zero_grad()
    if handle is not None:
        handle.remove()


@pytest.fixture
def pair():
    """The same model and optimizer twice."""
    model = make_mixed_net()
    other = copy.deepcopy(model)
    config = "adamw-24bit-companded"
    return (model, make_optimizer(model, config)), (other, make_optimizer(other, config))


def test_release_matches_ordinary_step_bitwise(pair):
    (model, optimizer), (ref, ref_optimizer) = pair
    _train(model, optimizer, release=True)
    _train(ref, ref_optimizer, release=False)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "release vs ordinary step")
    assert int(optimizer.state[model.uneven.weight]["step"]) == STEPS


def test_remove_restores_ordinary_steps(pair):
    (model, optimizer), (ref, ref_optimizer) = pair
    with enable_gradient_release(model, optimizer) as handle:
        assert handle.active and getattr(optimizer, "_step_supports_amp_scaling", False)
        _loss(model, 0).backward()
        optimizer.step()
    assert not handle.active and not hasattr(optimizer, "_step_supports_amp_scaling")
    _loss(model, 1).backward()
    assert model.uneven.weight.grad is not None, "after remove() gradients must stay for optimizer.step()"
    optimizer.step()
    optimizer.zero_grad()
    _train(ref, ref_optimizer, release=False, steps=2)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "release, remove, ordinary")
    handle.remove()  # idempotent
    enable_gradient_release(model, optimizer).remove()  # and it can be enabled again


def test_step_still_steps_parameters_outside_the_model():
    model = make_mixed_net()
    extra = torch.nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16))
    optimizer = flashdist.FlashAdamW([*model.parameters(), extra], lr=0.1, backend="reference")
    enable_gradient_release(model, optimizer)
    (_loss(model, 0) + extra.float().sum()).backward()
    assert extra.grad is not None and model.uneven.weight.grad is None
    optimizer.step()
    assert torch.all(extra < 1)


def test_refuses_gradient_accumulation(pair):
    (model, optimizer), _ = pair
    enable_gradient_release(model, optimizer)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        _loss(model, 1).backward()


def test_refuses_a_gradient_left_from_before(pair):
    (model, optimizer), _ = pair
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="'few' holds a gradient.*zero_grad"):
        enable_gradient_release(model, optimizer)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
def test_refuses_grad_scaler(pair, unscale_first):
    (model, optimizer), _ = pair
    enable_gradient_release(model, optimizer)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    if unscale_first:
        scaler.unscale_(optimizer)  # finds no gradient: nothing to refuse yet
    with pytest.raises(RuntimeError, match="GradScaler is stepping an optimizer with gradient release"):
        scaler.step(optimizer)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


@pytest.mark.parametrize("clip", ["clip_grad_norm_", "clip_grad_value_"])
def test_refuses_global_clipping(pair, clip):
    (model, optimizer), _ = pair
    original = getattr(torch.nn.utils, clip)
    handle = enable_gradient_release(model, optimizer)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=f"{clip} on parameter '.*', whose gradient release is active"):
        getattr(torch.nn.utils, clip)(model.parameters(), 1.0)
    # parameters outside any release handle are clipped as usual
    other = torch.nn.Parameter(torch.ones(3))
    other.grad = torch.full((3,), 10.0)
    getattr(torch.nn.utils, clip)([other], 1.0)
    assert other.grad.abs().max() <= 1.0 + 1e-6
    handle.remove()
    assert getattr(torch.nn.utils, clip) is original


def test_refuses_misuse():
    model = make_mixed_net()
    with pytest.raises(TypeError, match="flashdist optimizer"):
        enable_gradient_release(model, torch.optim.AdamW(model.parameters()))
    optimizer = flashdist.FlashAdamW(model.parameters(), backend="reference")
    enable_gradient_release(model, optimizer)
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_gradient_release(model, optimizer)
    with pytest.raises(ValueError, match="no trainable parameter"):
        enable_gradient_release(torch.nn.Linear(2, 2), flashdist.FlashAdamW(model.parameters()))


# ----- under FSDP2 ---------------------------------------------------------------------------------------


def _fsdp2_release(rank: int, world_size: int, mesh_shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    if world_size == 2:  # DDP reduces after the hooks: refused
        ddp = torch.nn.parallel.DistributedDataParallel(make_mixed_net())
        try:
            enable_gradient_release(ddp, make_optimizer(ddp.module, "adamw-24bit-companded"))
        except TypeError as e:
            assert "DistributedDataParallel" in str(e), str(e)
        else:
            raise AssertionError("release on a DDP model was not refused")

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = shard_mixed_net(make_mixed_net(), mesh)
    ref = shard_mixed_net(make_mixed_net(), mesh)
    optimizer = make_optimizer(model, "adamw-24bit-companded")
    ref_optimizer = make_optimizer(ref, "adamw-24bit-companded")

    # the hook fires on the sharded parameter with its reduced gradient (after the reduce-scatter and, for
    # HSDP, the all-reduce across replicas): the same result as the ordinary step
    _train(model, optimizer, release=True, rank=rank)
    _train(ref, ref_optimizer, release=False, rank=rank)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "FSDP2 release vs ordinary")

    # FSDP2's own accumulation (no reduce-scatter until the last micro-batch) steps once, correctly
    handle = enable_gradient_release(model, optimizer)
    for m, opt in ((model, optimizer), (ref, ref_optimizer)):
        m.set_requires_gradient_sync(False)
        _loss(m, 10, rank).backward()
        m.set_requires_gradient_sync(True)
        _loss(m, 11, rank).backward()
        opt.step()
        opt.zero_grad()
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "FSDP2 no-sync accumulation")

    # accumulation across reduce-scatters is refused, on every rank
    _loss(model, 12, rank).backward()
    try:
        _loss(model, 13, rank).backward()
    except RuntimeError as e:
        assert "second gradient before optimizer.step" in str(e), str(e)
    else:
        raise AssertionError("a second backward without optimizer.step() was not refused")
    handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=["2ranks", "3ranks", "hsdp-2x2"])
def test_fsdp2_release_matches_ordinary_step(mesh_shape):
    world_size = 1
    for n in mesh_shape:
        world_size *= n
    run_ranks(_fsdp2_release, world_size, mesh_shape)
