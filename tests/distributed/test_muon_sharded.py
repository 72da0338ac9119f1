"""FlashMuon's sharding promise: each matrix is orthogonalized whole on one owner rank, so a step under FSDP2
(1, 2, 3 ranks, uneven and empty shards), HSDP on a (2, 2) mesh, HSDP on pipeline stages' slices of a mesh,
and FSDP2 x tensor parallelism on (2, 2) and (1, 4) meshes is bit-identical to one process: parameters, master
weights, rho, momentum codes and scales, and the AdamW groups' state. A DCP checkpoint saved on 2 ranks resumes
on 3 (and the other way) in both state-dict formats, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_ranks
from sharding_cases import assert_bitwise_equal, check_state_layout, make_tiny_lm, shard_tiny_lm, single_threaded, snapshot

from flashdist import FlashMuon, checkpoint, muon_param_groups
from flashdist.distributed.gather import OwnerOrthogonalize

pytestmark = pytest.mark.slow  # multi-process

STEPS = 3
NAN_AT = (1, "blocks.0.fc1.weight", (5, 7))  # step, matrix, index: the matrix keeps its weight that step


def make_optimizer(model, fmt: str = "compressed") -> FlashMuon:
    return FlashMuon(muon_param_groups(model, adamw_lr=3e-3, adamw_weight_decay=0.0), lr=0.02,
                     state_dict_format=fmt, backend="reference")


def global_grads(model, step: int) -> dict[str, torch.Tensor]:
    """The same global gradients in every process: rows over four decades, a NaN in one matrix at step 1."""
    gen = torch.Generator().manual_seed(500 + step)
    grads = {}
    for name, p in sorted(model.named_parameters()):
        g = torch.randn(tuple(p.shape), generator=gen)
        if p.ndim:
            rows = torch.randint(-3, 1, (p.shape[0],), generator=gen).float()
            g = g * (10.0 ** rows).view(-1, *([1] * (p.ndim - 1)))
        grads[name] = g.to(p.dtype)
    if step == NAN_AT[0]:
        grads[NAN_AT[1]][NAN_AT[2]] = float("nan")
    return grads


def set_grads(model, grads) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = grads[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
            if isinstance(p, DTensor) else g.clone()


def train(model, optimizer, steps, first: int = 0) -> None:
    for step in range(first, first + steps):
        set_grads(model, global_grads(model, step))
        optimizer.step()


@single_threaded
def single_process(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], int]:
    model = make_tiny_lm()
    optimizer = make_optimizer(model)
    train(model, optimizer, steps)
    return snapshot(model, optimizer), int(optimizer.skipped)


def _fsdp_run(rank, world_size, folder, save_fmt, load_fmt):
    """STEPS steps against one process; then save the state (``save_fmt``) or resume from it (``load_fmt``)
    and take one more step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flashdist.distributed.gather import TRAFFIC

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    model = shard_tiny_lm(make_tiny_lm(), mesh)
    optimizer = make_optimizer(model)
    check_state_layout(model, optimizer)
    TRAFFIC.update(sent=0, received=0)
    train(model, optimizer, STEPS)
    traffic = torch.tensor([TRAFFIC["sent"], TRAFFIC["received"]], dtype=torch.float64)
    dist.all_reduce(traffic)
    out["traffic"] = traffic.tolist()
    skipped = optimizer.skipped.clone()
    dist.all_reduce(skipped)
    out["step"] = (snapshot(model, optimizer), int(skipped))
    for fmt in save_fmt:
        model = shard_tiny_lm(make_tiny_lm(), mesh)
        optimizer = make_optimizer(model, fmt)
        train(model, optimizer, STEPS - 1)
        checkpoint.save(f"{folder}/{fmt}", model, optimizer)
    for fmt in load_fmt:
        model = shard_tiny_lm(make_tiny_lm(), mesh)
        optimizer = make_optimizer(model, fmt)
        checkpoint.load(f"{folder}/{fmt}", model, optimizer)
        train(model, optimizer, 1, first=STEPS - 1)
        out[fmt] = snapshot(model, optimizer)
    return out if rank == 0 else None


def _check(result, label):
    want, want_skipped = single_process()
    got, skipped = result["step"]
    assert_bitwise_equal(got, want, f"FlashMuon step under FSDP2 on {label}")
    assert skipped == want_skipped == make_tiny_lm().get_parameter(NAN_AT[1]).numel(), (skipped, want_skipped)


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"{n}ranks")
def test_fsdp2_step_is_bit_identical(world_size):
    result = run_ranks(_fsdp_run, world_size, "", (), ())[0]
    _check(result, f"{world_size} ranks")
    # the exchange's bytes (flashdist.distributed.gather): each part of each Muon matrix off its owner goes
    # there and back once, bf16, padded to the largest part (torch.chunk's) and to an even length
    sent, received = result["traffic"]
    muon = [p for group in muon_param_groups(make_tiny_lm()) if group["use_muon"] for _, p in group["params"]]
    pads = [math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:]) for p in muon]
    want = sum(2 * (world_size - 1) * (pad + pad % 2) * 2 for pad in pads) * STEPS
    assert sent == received == want, (sent, received, want)
    numel = sum(p.numel() for p in muon)
    assert want <= 4 * (world_size - 1) / world_size * numel * STEPS * 1.05  # the budget, padding included


FORMATS = ("compressed", "portable")


def test_fsdp2_2_ranks_and_resume_on_3_and_1(tmp_path):
    """2 ranks: the step; a checkpoint saved there resumes on 3 ranks and in one process, bit for bit."""
    folder = str(tmp_path)
    _check(run_ranks(_fsdp_run, 2, folder, FORMATS, (), timeout=180)[0], "2 ranks")
    want, _ = single_process()
    resumed = run_ranks(_fsdp_run, 3, folder, (), FORMATS, timeout=180)[0]
    for fmt in FORMATS:
        assert_bitwise_equal(resumed[fmt], want, f"{fmt} checkpoint of 2 ranks resumed on 3")
    model = make_tiny_lm()
    for fmt in FORMATS:
        optimizer = make_optimizer(model, fmt)
        checkpoint.load(f"{folder}/{fmt}", model, optimizer)
        train(model, optimizer, 1, first=STEPS - 1)
        assert_bitwise_equal(snapshot(model, optimizer), want, f"{fmt} checkpoint of 2 ranks resumed in one process")
        model = make_tiny_lm()


# ----- FSDP2 x tensor parallelism -------------------------------------------------------------------------


def _tp_optimizer(model):
    return FlashMuon(muon_param_groups(model), lr=0.02, backend="reference")


def _tp_train(model, optimizer):
    from test_tensor_parallel import global_grads as tp_grads
    from test_tensor_parallel import set_grads as tp_set_grads

    for step in range(STEPS):
        tp_set_grads(model, tp_grads(step))
        optimizer.step()


@single_threaded
def tp_single_process():
    from test_tensor_parallel import make_block

    model = make_block()
    optimizer = _tp_optimizer(model)
    _tp_train(model, optimizer)
    return snapshot(model, optimizer), int(optimizer.skipped)


def _tp_run(rank, world_size, mesh_shape):
    import torch.distributed as dist
    from test_tensor_parallel import _mesh, _placements_seen, make_block, parallelize

    from flashdist.distributed.gather import TRAFFIC

    model = parallelize(make_block(), _mesh(mesh_shape))
    optimizer = _tp_optimizer(model)
    TRAFFIC.update(sent=0, received=0)
    _tp_train(model, optimizer)
    skipped = optimizer.skipped.clone()
    dist.all_reduce(skipped)  # no Muon matrix is replicated on this mesh: each value is counted once
    # the experts stack (flatten=False), sharded on its experts dim only, holds whole matrices: orthogonalized
    # where they are, nothing sent; the mixer stack, sharded inside its matrices (Shard(1)), travels
    expert_group = next(g for g in optimizer.param_groups if any(p is model.experts for p in g["params"]))
    local = [OwnerOrthogonalize([p], stacked=[True]).local[0] for p in (model.experts, model.mixer)]
    traffic = torch.tensor([TRAFFIC["sent"]], dtype=torch.float64)
    dist.all_reduce(traffic)
    out = (snapshot(model, optimizer), int(skipped), _placements_seen(model),  # (a collective: every rank)
           (expert_group.get("flatten"), local, float(traffic)))
    return out if rank == 0 else None


@pytest.mark.parametrize("mesh_shape", [(2, 2), (1, 4)], ids=lambda m: "x".join(map(str, m)))
def test_fsdp2_x_tp_step_is_bit_identical(mesh_shape):
    got, skipped, placements, (flatten, local, sent) = run_ranks(_tp_run, 4, mesh_shape, timeout=180)[0]
    assert {"Shard(0)", "Shard(1)"} <= placements, placements
    assert flatten is False and local == [True, False] and sent > 0, (flatten, local, sent)
    want, want_skipped = tp_single_process()
    assert_bitwise_equal(got, want, f"FlashMuon step under FSDP2 x TP at {mesh_shape}")
    assert skipped == want_skipped > 0, (skipped, want_skipped)


def _hsdp_run(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = []
    for relay in (False, True):
        with _relayed(relay):
            model = shard_tiny_lm(make_tiny_lm(), mesh)
            optimizer = make_optimizer(model)
            train(model, optimizer, STEPS)
        skipped = optimizer.skipped.clone()
        dist.all_reduce(skipped, group=mesh.get_group("shard"))  # (the replicas count the same values)
        results.append((snapshot(model, optimizer), int(skipped)))  # (each rank's view: its replica's shards)
    return results


def test_hsdp_2x2_step_is_bit_identical():
    """(Replicate, Shard(0)): every rank of both replicas ends with the one-process bits, through the group
    over the whole mesh and through the hops along each mesh dim that a mesh over some of the ranks takes."""
    for rank, results in enumerate(run_ranks(_hsdp_run, 4, timeout=180)):
        for result, route in zip(results, ("one group", "hops along the dims")):
            _check({"step": result}, f"HSDP 2x2 ({route}), rank {rank}")


class _relayed:
    """Within it, a matrix on a mesh of several dims reaches its owner in hops along the dims (what a mesh
    over some of the ranks, a pipeline stage's, takes), where one group over the mesh would otherwise serve."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        from flashdist.distributed import gather

        self.saved = gather._one_group
        if self.on:
            gather._one_group = lambda mesh: mesh.get_group(0) if mesh.ndim == 1 else None
        gather._ROUTES.clear()

    def __exit__(self, *exc):
        from flashdist.distributed import gather

        gather._one_group = self.saved
        gather._ROUTES.clear()


def _stage_run(rank, world_size):
    """Pipeline-style: each stage of 2 ranks runs HSDP on its own (replicate 1, shard 2) slice of a
    (pp 2, replicate 1, shard 2) mesh, which no group over the world serves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "replicate", "shard"))
    model = shard_tiny_lm(make_tiny_lm(), mesh["replicate", "shard"])
    optimizer = make_optimizer(model)
    train(model, optimizer, STEPS)
    skipped = optimizer.skipped.clone()
    dist.all_reduce(skipped, group=mesh.get_group("shard"))  # (the stage's ranks count their own shards)
    return snapshot(model, optimizer), int(skipped)


def test_pipeline_stage_meshes_step_is_bit_identical():
    """A 2-D mesh over some of the ranks (a pipeline stage's HSDP) steps with the one-process bits on every
    rank of every stage (it was refused at the first step, after earlier matrices had stepped)."""
    for rank, result in enumerate(run_ranks(_stage_run, 4, timeout=180)):
        _check({"step": result}, f"pipeline stage {rank // 2}, rank {rank}")


# ----- gradient release -------------------------------------------------------------------------------------


def _release_run(rank, world_size):
    """Release steps each FSDP2 group's matrices inside backward, as soon as their gradients are reduced: each
    rank makes the same step_parameters calls in the same order, so the owners' exchanges line up. With uneven
    shards too: a bucket of 100 bytes over three (3, 16) fp32 matrices (2 rows on rank 0, 1 on rank 1) is
    full after the first group on rank 0 and after the second on rank 1 if each counts its own bytes, and
    then the ranks' exchanges and FSDP2's reduce-scatters interleave differently (a hang)."""
    from sharding_cases import lm_batch, lm_loss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flashdist import enable_gradient_release

    mesh = init_device_mesh("cpu", (world_size,))

    def uneven():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(16, 3, bias=False) for _ in range(3)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def uneven_loss(model, step):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step * world_size + rank))
        return sum(torch.tanh(layer(x)).pow(2).sum() for layer in model)

    cases = [(lambda: shard_tiny_lm(make_tiny_lm(), mesh), make_optimizer, 0,
              lambda m, step: lm_loss(m, lm_batch(step * world_size + rank, 4))),
             (uneven, lambda m: FlashMuon(m.parameters(), lr=0.02, backend="reference"), 100 / 2**20, uneven_loss)]
    for build, optimizer_of, bucket_mb, loss in cases:
        model, ref = build(), build()
        optimizer, ref_optimizer = optimizer_of(model), optimizer_of(ref)
        handle = enable_gradient_release(model, optimizer, bucket_mb=bucket_mb)
        for step in range(STEPS):
            for m, opt in ((model, optimizer), (ref, ref_optimizer)):
                loss(m, step).backward()
                opt.step()
                opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        handle.remove()
        got, want = snapshot(model, optimizer), snapshot(ref, ref_optimizer)
        assert_bitwise_equal(got, want, f"FlashMuon with gradient release ({bucket_mb * 2**20:.0f} B) on "
                                        f"{world_size} ranks")


def test_fsdp2_gradient_release_matches_the_ordinary_step():
    run_ranks(_release_run, 2, timeout=180)
