"""Gradient release, in one process and under FSDP2: the same result as the ordinary step, gradients freed
during backward, parameters stepped in batches (buckets of gradients: whole FSDP2 groups, or parameters in
arrival order in one process; one optimizer call per batch and param group), hooks fired outside backward,
remove() restoring ordinary steps, and the refusals (accumulation, GradScaler, clipping, DDP)."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks
from sharding_cases import (CONFIGS, MixedNet, assert_bitwise_equal, make_mixed_net, make_optimizer,
                            shard_mixed_net, snapshot)
from torch import nn

import flashdist
from flashdist import enable_gradient_release

STEPS = 3


def _batch(step: int, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 40, generator=gen).to(torch.bfloat16)


def _loss(model, step: int, rank: int = 0) -> torch.Tensor:
    return model(_batch(step, rank)).float().pow(2).mean()


def _train(model, optimizer, *, release: bool, rank: int = 0, steps: int = STEPS, bucket_mb: float = 64.0) -> None:
    handle = enable_gradient_release(model, optimizer, bucket_mb=bucket_mb) if release else None
    for step in range(steps):
        _loss(model, step, rank).backward()
        if release:
            assert all(p.grad is None for p in model.parameters()), "release left a gradient behind"
        optimizer.step()
        optimizer.zero_grad()
    if handle is not None:
        handle.remove()


class GatedNet(MixedNet):
    """MixedNet whose ``cube`` takes part only while ``use_cube``: a parameter that has a gradient in some
    iterations and none in others (its optimizer step count falls behind the others')."""

    use_cube = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.uneven(x))
        extra = self.few.sum(1).sum() + self.gain[:7].sum() * 0.1
        if self.use_cube:
            extra = extra + self.cube.mean()
        h = (h + extra * 0.01) * self.gain[:7]
        return self.head(h.float()).sum(-1)


def make_gated_net() -> GatedNet:
    model = make_mixed_net()
    model.__class__ = GatedNet  # same parameters, same initial values
    return model


def _train_gated(model, optimizer, *, release: bool, rank: int = 0, steps: int = 4) -> None:
    """cube used at steps 0, 2, 3 only. The reference (ordinary step) drops the optimizer's cached plans
    before each step: a plan reused after another list of parameters stepped some of its parameters keeps
    its own copy of their step counts (flashdist/optim/base.py), which release must not inherit."""
    handle = enable_gradient_release(model, optimizer) if release else None
    for step in range(steps):
        model.use_cube = step != 1
        _loss(model, step, rank).backward()
        if release:
            assert all(p.grad is None for p in model.parameters()), "release left a gradient behind"
        else:
            optimizer.clear_plans()
        optimizer.step()
        optimizer.zero_grad()
    if handle is not None:
        handle.remove()


def spy_calls(optimizer) -> list[list[str]]:
    """Record the names of the parameters of every non-empty ``step_parameters`` call (the batched optimizer
    call) and, after each name list, whether every other trainable parameter held no gradient then."""
    calls: list = []
    original = optimizer.step_parameters
    names = {id(p): n for g in optimizer.param_groups for n, p in zip(g["param_names"], g["params"])}
    every = [p for g in optimizer.param_groups for p in g["params"]]

    def spy(group, params, *args, **kwargs):
        if params:
            stepped = {id(p) for p in params}
            held = sorted(names[id(p)] for p in every if p.grad is not None and id(p) not in stepped)
            calls.append((sorted(names[id(p)] for p in params), held))
        return original(group, params, *args, **kwargs)

    optimizer.step_parameters = spy
    return calls


@pytest.fixture
def pair():
    """The same model and optimizer twice."""
    model = make_mixed_net()
    other = copy.deepcopy(model)
    return (model, make_optimizer(model)), (other, make_optimizer(other))


def test_release_matches_ordinary_step_bitwise(pair):
    (model, optimizer), (ref, ref_optimizer) = pair
    _train(model, optimizer, release=True)
    _train(ref, ref_optimizer, release=False)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "release vs ordinary step")
    assert int(optimizer.state[model.uneven.weight]["step"]) == STEPS


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_release_matches_ordinary_step_for_every_optimizer(config):
    model, ref = make_mixed_net(), make_mixed_net()
    optimizer, ref_optimizer = make_optimizer(model, config), make_optimizer(ref, config)
    _train(model, optimizer, release=True)
    _train(ref, ref_optimizer, release=False)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), f"{config}: release")


def test_failed_batched_step_leaves_the_rest_to_optimizer_step(pair):
    """A batch's step that raises midway (here the second param group's call) leaves the parameters it did
    not step queued with their gradients: optimizer.step() steps them, each parameter exactly once, and the
    result is the ordinary step's."""
    (model, optimizer), (ref, ref_optimizer) = pair
    handle = enable_gradient_release(model, optimizer)
    original = optimizer.step_parameters
    calls = []

    def fail_second(group, params, *args, **kwargs):
        calls.append(len(params))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return original(group, params, *args, **kwargs)

    optimizer.step_parameters = fail_second
    with pytest.raises(RuntimeError, match="injected failure"):
        _loss(model, 0).backward()
    assert sum(p.grad is not None for p in model.parameters()) == calls[1]  # the second group kept its grads
    optimizer.step_parameters = original
    optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    _loss(ref, 0).backward()
    ref_optimizer.step()
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "failed batch, then step()")


def test_one_process_steps_one_batch_per_param_group(pair):
    """Small model, default bucket: the whole backward is one batch, one optimizer call per param group,
    stepped by the end-of-backward callback; frozen and unused parameters are not in it."""
    (model, optimizer), _ = pair
    calls = spy_calls(optimizer)
    handle = enable_gradient_release(model, optimizer)
    for step in range(2):
        calls.clear()
        _loss(model, step).backward()
        assert sorted(c[0] for c in calls) == [["cube", "few"], ["gain", "head.bias", "head.weight", "uneven.bias",
                                                                 "uneven.weight"]]
        assert handle.optimizer_calls == 2 * (step + 1)
        assert all(p.grad is None for p in model.parameters())
        optimizer.step()
    handle.remove()


def test_hook_fired_outside_backward_steps_at_once(pair):
    """FSDP2 calls the post-accumulate-grad hooks itself, after its reduce-scatter. Where that happens outside
    autograd's backward no end-of-backward callback can be queued, so the hook steps its parameter at once
    and frees the gradient; the result is the ordinary step's."""
    (model, optimizer), (ref, ref_optimizer) = pair
    _loss(ref, 0).backward()
    grads = {name: p.grad.clone() for name, p in ref.named_parameters() if p.grad is not None}
    ref_optimizer.step()
    handle = enable_gradient_release(model, optimizer)
    calls = spy_calls(optimizer)
    for name, p in model.named_parameters():
        if name in grads:
            p.grad = grads[name].clone()
            for hook in p._post_accumulate_grad_hooks.values():  # as FSDP2's foreach_reduce does
                hook(p)
            assert p.grad is None, name
    assert sorted(names for names, _ in calls) == sorted([name] for name in grads)
    optimizer.step()
    handle.remove()
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "hooks outside backward")


@pytest.mark.parametrize("bucket_mb", [0, 600 / 2**20], ids=["per-parameter", "600-bytes"])
def test_one_process_buckets_bound_the_gradients_held(pair, bucket_mb):
    """With a small bucket the gradients are stepped and freed during backward, in several calls: whenever a
    batch is stepped, the gradients held in all (that batch included) are under one bucket plus the one
    gradient that filled it; the result is the ordinary step's, bit for bit."""
    (model, optimizer), (ref, ref_optimizer) = pair
    calls = spy_calls(optimizer)
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    handle = enable_gradient_release(model, optimizer, bucket_mb=bucket_mb)
    for step in range(STEPS):
        calls.clear()
        _loss(model, step).backward()
        stepped = [n for names, _ in calls for n in names]
        assert sorted(stepped) == sorted(n for n, p in model.named_parameters()
                                         if p.requires_grad and n != "unused"), "each parameter once"
        if bucket_mb == 0:
            assert all(len(names) == 1 and not held for names, held in calls), calls
        else:
            assert len(calls) >= 3, calls
            largest = max(sizes.values())
            for names, held in calls:  # one batch: under a bucket, plus the gradient that filled it
                assert sum(sizes[n] for n in names + held) < 600 + largest, (names, held)
        optimizer.step()
        optimizer.zero_grad()
    handle.remove()
    _train(ref, ref_optimizer, release=False)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "bucketed release")


def test_parameter_without_gradient_in_some_steps():
    """A parameter that skips a step falls one step count behind the others, as with the ordinary step; the
    batch that lacks it is another list of parameters, whose stepping must not disturb the step counts."""
    model, ref = make_gated_net(), make_gated_net()
    optimizer = make_optimizer(model)
    ref_optimizer = make_optimizer(ref)
    _train_gated(model, optimizer, release=True)
    _train_gated(ref, ref_optimizer, release=False)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), "gated release")
    assert int(optimizer.state[model.cube]["step"]) == 3 and int(optimizer.state[model.few]["step"]) == 4


def test_refuses_bad_bucket_size(pair):
    (model, optimizer), _ = pair
    for bad in (-1, float("nan"), float("inf"), "8", True):
        with pytest.raises(ValueError, match="bucket_mb"):
            enable_gradient_release(model, optimizer, bucket_mb=bad)
    enable_gradient_release(model, optimizer, bucket_mb=0).remove()


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
            enable_gradient_release(ddp, make_optimizer(ddp.module))
        except TypeError as e:
            assert "DistributedDataParallel" in str(e), str(e)
        else:
            raise AssertionError("release on a DDP model was not refused")

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    model = shard_mixed_net(make_mixed_net(), mesh)
    ref = shard_mixed_net(make_mixed_net(), mesh)
    optimizer = make_optimizer(model)
    ref_optimizer = make_optimizer(ref)

    # the hooks fire on the sharded parameters with their reduced gradients (after the reduce-scatter and,
    # for HSDP, the all-reduce across replicas): the same result as the ordinary step. With bucket_mb=0 one
    # optimizer call per FSDP group and param group: the head group (param group 0), the root group's part
    # of param group 0 (its 'unused' parameter gets no gradient, so the root is stepped at the end of
    # backward) and of 1
    calls = spy_calls(optimizer)
    _train(model, optimizer, release=True, rank=rank, bucket_mb=0)
    assert sorted(names for names, _ in calls) == sorted(STEPS * [["head.bias", "head.weight"], ["cube", "few"],
                                                                 ["gain", "uneven.bias", "uneven.weight"]]), calls
    assert all(not held for names, held in calls if names[0] == "head.bias"), "the head group is stepped first"
    del optimizer.step_parameters
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


class Stack(nn.Module):
    """Three layers, each its own FSDP group, and a root parameter: every parameter gets a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList(nn.Linear(40, 40) for _ in range(3))
        self.scale = nn.Parameter(torch.rand(40) + 0.5)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x * self.scale).float().sum(-1)


def _sharded_stack(mesh):
    from torch.distributed.fsdp import fully_shard

    model = Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # a param group split across the FSDP groups: weights and 'scale' in one, biases in the other
    named = list(model.named_parameters())
    optimizer = flashdist.FlashAdamW([{"params": [(n, p) for n, p in named if not n.endswith("bias")]},
                                      {"params": [(n, p) for n, p in named if n.endswith("bias")], "lr": 3e-2}],
                                     lr=1e-2, weight_decay=0.1, backend="reference")
    return model, optimizer


def _stack_release_vs_ordinary(mesh, rank: int, bucket_mb: float, check_calls, label: str) -> float:
    """Train the FSDP2 stack with release (``check_calls`` sees each backward's optimizer calls) and without;
    the results must be bit-identical. Returns the optimizer calls per step."""
    (model, optimizer), (ref, ref_optimizer) = _sharded_stack(mesh), _sharded_stack(mesh)
    calls = spy_calls(optimizer)
    handle = enable_gradient_release(model, optimizer, bucket_mb=bucket_mb)
    for step in range(STEPS):
        calls.clear()
        _loss(model, step, rank).backward()
        assert all(p.grad is None for p in model.parameters())
        check_calls(calls)
        optimizer.step()
        optimizer.zero_grad()
    per_step = handle.optimizer_calls / STEPS
    handle.remove()
    del optimizer.step_parameters
    _train(ref, ref_optimizer, release=False, rank=rank)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(ref, ref_optimizer), label)
    return per_step


def _fsdp2_batches(rank: int, world_size: int):
    """With bucket_mb=0 each FSDP group is stepped, one call per param group, as soon as its reduce-scatter
    is done: while a group is stepped no other group holds a gradient. With the default bucket (64 MiB,
    more than this model) the whole backward is one batch, stepped by the end-of-backward callback with one
    call per param group. Parameters that get a gradient in some iterations only (GatedNet) step correctly."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))

    def one_group_at_a_time(calls):
        # (FSDP2 reduces layers.0, whose input needs no gradient, in its end-of-backward callback)
        assert sorted(names for names, _ in calls) == [
            ["layers.0.bias"], ["layers.0.weight"], ["layers.1.bias"], ["layers.1.weight"], ["layers.2.bias"],
            ["layers.2.weight"], ["scale"]], calls
        for names, held in calls:  # only the same FSDP group's other param group may still hold gradients
            assert all(h.split(".")[:2] == names[0].split(".")[:2] for h in held), (names, held)

    def one_batch(calls):
        assert sorted(sorted(names) for names, _ in calls) == [
            ["layers.0.bias", "layers.1.bias", "layers.2.bias"],
            ["layers.0.weight", "layers.1.weight", "layers.2.weight", "scale"]], calls

    assert _stack_release_vs_ordinary(mesh, rank, 0, one_group_at_a_time, "FSDP2 stack release") == 7
    assert _stack_release_vs_ordinary(mesh, rank, 64, one_batch, "FSDP2 stack, one batch") == 2

    gated, gated_ref = (shard_mixed_net(make_gated_net(), mesh) for _ in range(2))
    gated_optimizer = make_optimizer(gated)
    gated_ref_optimizer = make_optimizer(gated_ref)
    _train_gated(gated, gated_optimizer, release=True, rank=rank)
    _train_gated(gated_ref, gated_ref_optimizer, release=False, rank=rank)
    assert_bitwise_equal(snapshot(gated, gated_optimizer), snapshot(gated_ref, gated_ref_optimizer),
                         "FSDP2 gated release")


@pytest.mark.slow
def test_fsdp2_release_batches_groups_by_bucket():
    run_ranks(_fsdp2_batches, 2)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=["2ranks", "3ranks", "hsdp-2x2"])
def test_fsdp2_release_matches_ordinary_step(mesh_shape):
    world_size = 1
    for n in mesh_shape:
        world_size *= n
    run_ranks(_fsdp2_release, world_size, mesh_shape)


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a backward pass that fails midway, after the
    parameters behind it (closer to the loss) already received their gradients."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected failure")
        return g


class FailingNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(40, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        return self.second(_FailOnce.apply(torch.tanh(self.first(x))))


@pytest.mark.parametrize("zero_grad", [True, False], ids=["zero_grad", "no-zero_grad"])
def test_a_failed_backward_leaves_release_usable(zero_grad):
    """The failed pass stepped nothing it had not finished (the bucket holds everything); afterwards
    zero_grad() + step() does not crash, the next backward is not mistaken for accumulation, and training
    goes on exactly like an ordinary run that skipped the failed iteration."""
    model = FailingNet().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    opt = flashdist.FlashAdamW(model.parameters(), lr=1e-2)
    ref_opt = flashdist.FlashAdamW(reference.parameters(), lr=1e-2)
    release = enable_gradient_release(model, opt, bucket_mb=1024)
    _FailOnce.armed = True
    with pytest.raises(RuntimeError, match="injected failure"):
        _loss(model, 0).backward()
    assert model.second.weight.grad is not None  # reached before the failure, not stepped
    if zero_grad:
        opt.zero_grad()
        opt.step()  # nothing left to step: no error
        assert int(opt.state[model.second.weight].get("step", 0)) == 0
    else:
        opt.step()  # steps what the failed pass left (as the ordinary step would)
    for step in range(1, 3):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    release.remove()
    if zero_grad:
        for step in range(1, 3):
            _loss(reference, step).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert_bitwise_equal(snapshot(model, opt), snapshot(reference, ref_opt), "after a failed backward")
    else:
        assert int(opt.state[model.second.weight]["step"]) == 3
        assert int(opt.state[model.first.weight]["step"]) == 2
