"""Tensor parallelism: FSDP2 x TP (x expert parallel) meshes keep the sharding promise.

A Llama-style block (attention q/k/v/o, MLP gate/up/down, two RMSNorms) under ColwiseParallel,
RowwiseParallel and SequenceParallel, FSDP2 over the dp mesh dim on top, and a 3-D mixture-of-experts weight
sharded on its experts dim, on 4 gloo ranks at (dp, tp) = (2, 2), (1, 4), (4, 1). Given the same global
gradients, a step is bit-identical to one process (parameters, master weights, rho, codes, scales as whole
tensors), shards are uneven and some empty. A DCP checkpoint saved at (2, 2) loads at (1, 4), (4, 1) and in one
process bit for bit, in both state-dict formats. The placement rule itself is checked without processes."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from sharding_cases import NoCollectives, assert_bitwise_equal, check_state_layout, single_threaded, snapshot
from torch import nn

from flashdist import FlashAdamW, checkpoint, export_fp32_state_dict, load_fp32_state_dict
from flashdist import distributed as D
from flashdist.distributed.placements import placement_problem
from flashdist.quant.codes import GROUP

pytestmark = pytest.mark.slow  # multi-process (the rule's own tests below take milliseconds)

STEPS = 3
DIM, HIDDEN = 48, 127  # HIDDEN: gate/up rows and down's row of 127 values, uneven on 2 and 4 ranks


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, 128, bias=False)
        self.wk = nn.Linear(DIM, 36, bias=False)
        self.wv = nn.Linear(DIM, 30, bias=False)  # 30 rows: 8, 8, 8, 6 on 4 tensor-parallel ranks
        self.wo = nn.Linear(128, DIM, bias=False)  # RowwiseParallel: 32 or 64 of each row of 128 per rank


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)  # RowwiseParallel: pieces of 64 + 63, or 32, 32, 32, 31


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()
        self.experts = nn.Parameter(torch.randn(6, 40, 24) * 0.1)  # (experts, out, in): 6 experts on 4 ranks
        # sharded on dim 1 inside its rows of 7 x 32 values: pieces of 4 + 3 x 32 at tp 2, 2, 2, 2, 1 x 32 at tp 4
        self.mixer = nn.Parameter(torch.randn(5, 7, 32) * 0.1)


def make_block() -> Block:
    torch.manual_seed(0)
    return Block().to(torch.bfloat16)


TP_PLAN = {"attention_norm": "sequence", "attention.wq": "colwise", "attention.wk": "colwise",
           "attention.wv": "colwise", "attention.wo": "rowwise", "ffn_norm": "sequence",
           "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}


def parallelize(model: Block, mesh) -> Block:
    """torchtitan's recipe: tensor parallelism inside the tp mesh dim, the experts sharded on the tp dim too
    (expert parallelism), then FSDP2 over the dp mesh dim (which makes the dim-0 shards _StridedShard)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    parallelize_module(model, mesh["tp"], {name: styles[style]() for name, style in TP_PLAN.items()})
    model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh["tp"], [Shard(0)], src_data_rank=None))
    model.mixer = nn.Parameter(distribute_tensor(model.mixer.data, mesh["tp"], [Shard(1)], src_data_rank=None))
    fully_shard(model, mesh=mesh["dp"])
    return model


def make_optimizer(model: nn.Module, fmt: str = "compressed") -> FlashAdamW:
    return FlashAdamW(model.named_parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, backend="reference",
                      state_dict_format=fmt)


def global_grads(step: int) -> dict[str, torch.Tensor]:
    """The same global gradients in every process, rows over four decades; a NaN at step 1 in a row piece of
    a RowwiseParallel weight (its group must be skipped on whichever rank holds it)."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = {}
    for name, p in sorted(make_block().named_parameters()):
        g = torch.randn(tuple(p.shape), generator=gen)
        rows = torch.randint(-3, 1, (p.shape[0],), generator=gen).float()
        grads[name] = (g * (10.0 ** rows).view(-1, *([1] * (p.ndim - 1)))).to(torch.bfloat16)
    if step == 1:
        grads["attention.wo.weight"][3, 70] = float("nan")
    return grads


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = grads[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
            if isinstance(p, DTensor) else g.clone()


def train(model, optimizer, steps: int = STEPS, check_no_collectives: bool = False) -> None:
    for step in range(steps):
        set_grads(model, global_grads(step))
        with NoCollectives() as seen:
            optimizer.step()
        if check_no_collectives:
            assert not seen.collectives and not seen.dtensor_ops, (seen.collectives, seen.dtensor_ops)


@single_threaded
def single_process(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], int]:
    model = make_block()
    optimizer = make_optimizer(model)
    train(model, optimizer, steps)
    return snapshot(model, optimizer), int(optimizer.skipped)


def _mesh(mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))


def _placements_seen(model) -> set[str]:
    return {f"{type(pl).__name__}({pl.dim})" for p in model.parameters() for pl in p.placements
            if hasattr(pl, "dim")}


def _mesh_run(rank, world_size, mesh_shape, folder, save):
    """The step at this mesh against one process; then save (at (2, 2)) or load the (2, 2) checkpoint."""
    import torch.distributed as dist

    mesh = _mesh(mesh_shape)
    model = parallelize(make_block(), mesh)
    optimizer = make_optimizer(model)
    check_state_layout(model, optimizer)
    train(model, optimizer, check_no_collectives=True)
    check_state_layout(model, optimizer)
    skipped = optimizer.skipped.clone()
    dist.all_reduce(skipped)  # each rank counts the skipped groups of its pieces; no piece is replicated
    out = {"step": snapshot(model, optimizer), "skipped": int(skipped), "placements": _placements_seen(model)}
    for fmt in ("compressed", "portable"):
        path = f"{folder}/{fmt}"
        model = parallelize(make_block(), mesh)
        optimizer = make_optimizer(model, fmt)
        if save:
            train(model, optimizer)
            checkpoint.save(path, model, optimizer)
        else:
            checkpoint.load(path, model, optimizer)
        out[fmt] = snapshot(model, optimizer)
    # fp32 master weights: exported from the sharded model, and loaded back into a fresh one
    exported = export_fp32_state_dict(model, optimizer, rank0_only=False)
    fresh = parallelize(make_block(), mesh)
    fresh_optimizer = make_optimizer(fresh)
    load_fp32_state_dict(fresh, fresh_optimizer, exported)
    out["fp32"] = exported
    out["fp32-loaded"] = {name: D.full_tensor(fresh_optimizer.master_weight(p)) for name, p in fresh.named_parameters()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def saved_at_2x2(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp-checkpoint"))
    return folder, run_ranks(_mesh_run, 4, (2, 2), folder, True, timeout=240)[0]


def _check_run(result, label):
    want, want_skipped = single_process()
    assert_bitwise_equal(result["step"], want, f"step at {label}")
    assert result["skipped"] == want_skipped > 0, (label, result["skipped"], want_skipped)
    for fmt in ("compressed", "portable"):
        assert_bitwise_equal(result[fmt], want, f"{fmt} checkpoint loaded at {label}")
    reference = single_process_fp32()
    assert_bitwise_equal(result["fp32"], reference, f"fp32 export at {label}")
    assert_bitwise_equal(result["fp32-loaded"], reference, f"fp32 weights loaded at {label}")


@single_threaded
def single_process_fp32() -> dict[str, torch.Tensor]:
    model = make_block()
    optimizer = make_optimizer(model)
    train(model, optimizer)
    return export_fp32_state_dict(model, optimizer)


def test_2x2_step_and_save_are_bit_identical(saved_at_2x2):
    _, result = saved_at_2x2
    assert {"_StridedShard(0)", "Shard(0)", "Shard(1)"} <= result["placements"], result["placements"]
    _check_run(result, "(dp, tp) = (2, 2)")


@pytest.mark.parametrize("mesh_shape", [(1, 4), (4, 1)], ids=["tp4", "dp4"])
def test_step_and_load_from_2x2_are_bit_identical(saved_at_2x2, mesh_shape):
    folder, _ = saved_at_2x2
    result = run_ranks(_mesh_run, 4, mesh_shape, folder, False, timeout=240)[0]
    _check_run(result, f"(dp, tp) = {mesh_shape}")


@pytest.mark.parametrize("fmt", ["compressed", "portable"])
def test_2x2_checkpoint_loads_in_one_process(saved_at_2x2, fmt):
    folder, _ = saved_at_2x2
    model = make_block()
    optimizer = make_optimizer(model, fmt)
    checkpoint.load(f"{folder}/{fmt}", model, optimizer)
    assert_bitwise_equal(snapshot(model, optimizer), single_process()[0], f"{fmt} checkpoint loaded in one process")


def test_cli_inspects_and_exports_a_2x2_checkpoint(saved_at_2x2, tmp_path, capsys):
    import json

    from flashdist.cli import main

    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is part of the [test] extra")
    folder, _ = saved_at_2x2
    capsys.readouterr()
    assert main(["inspect", f"{folder}/compressed", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["optimizer_format"] == "compressed", info
    assert info["parameters"] == sum(p.numel() for p in make_block().parameters()), info
    for fmt in ("compressed", "portable"):
        assert main(["export", f"{folder}/{fmt}", str(tmp_path / f"{fmt}.safetensors")]) == 0
        exported = safetensors.load_file(tmp_path / f"{fmt}.safetensors")
        assert_bitwise_equal(exported, single_process_fp32(), f"flashdist export of the {fmt} (2, 2) checkpoint")


# ----- gradient release and clipping under FSDP2 x TP ------------------------------------------------------


class MLP(nn.Module):
    # 128 hidden features: even shards (TP's forward needs them; the step test above covers uneven ones)
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 128, bias=False)
        self.w3 = nn.Linear(DIM, 128, bias=False)
        self.w2 = nn.Linear(128, DIM, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def _mlp(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    if mesh is not None:
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                               "w2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    return model


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + dp_rank)).to(torch.bfloat16)


def _release_and_clip(rank, world_size):
    from flashdist import enable_gradient_release

    mesh = _mesh((2, 2))
    dp_rank = mesh.get_local_rank("dp")
    runs = {}
    for release in (False, True):
        model = _mlp(mesh)
        optimizer = make_optimizer(model)
        handle = enable_gradient_release(model, optimizer, bucket_mb=0) if release else None
        for step in range(3):
            model(_batch(step, dp_rank)).float().pow(2).mean().backward()  # under release: stepped by hooks
            if release and step == 2:
                try:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                except RuntimeError as e:
                    runs["clip-under-release"] = str(e)
            optimizer.step()
            optimizer.zero_grad()
        if release:
            handle.remove()
        runs[release] = snapshot(model, optimizer)
    # clipping over the 2-D mesh: torch's clip_grad_norm_ reduces the DTensor norms over both mesh dims
    model = _mlp(mesh)
    optimizer = make_optimizer(model)
    model(_batch(0, dp_rank)).float().pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    runs["norm"] = D.full_tensor(norm).float()
    runs["clipped"] = {n: D.full_tensor(p.grad).float() for n, p in model.named_parameters()}
    optimizer.step()
    return runs if rank == 0 else None


def test_gradient_release_and_clipping_under_fsdp2_x_tp():
    runs = run_ranks(_release_and_clip, 4, timeout=180)[0]
    assert_bitwise_equal(runs[True], runs[False], "gradient release vs ordinary steps at (dp, tp) = (2, 2)")
    assert "clip_grad_norm_" in runs["clip-under-release"], runs["clip-under-release"]
    # the same global gradient in one process: FSDP2 averages the two dp ranks' gradients
    model = _mlp(None)
    loss = sum(model(_batch(0, r)).float().pow(2).mean() for r in range(2)) / 2
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    # torch sums bf16 gradients per shard and in another order: agreement to bf16 precision, not bits
    torch.testing.assert_close(runs["norm"], norm.float(), rtol=2e-2, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(runs["clipped"][name], p.grad.float(), rtol=2e-2, atol=1e-6)


# ----- the placement rule, without processes ----------------------------------------------------------------


def _shard(d):
    from torch.distributed.tensor import Shard

    return Shard(d)


@pytest.mark.parametrize("shape, mesh_shape, placements, accepted", [
    ((48, 128), (4,), ("S1",), True),  # RowwiseParallel, 32 values of each row per rank
    ((48, 127), (4,), ("S1",), True),  # 32, 32, 32, 31: the last piece ends at the row's end
    ((48, 96), (4,), ("S1",), False),  # 24 values per rank: cuts groups
    ((48, 96), (3,), ("S1",), True),
    ((48, 128), (2, 2), ("S0", "S1"), True),  # FSDP2 x RowwiseParallel
    ((48, 128), (2, 2), ("S1", "S1"), True),  # two mesh dims on one dim inside the row: 32 each
    ((48, 128), (2, 4), ("S1", "S1"), False),  # ... 16 each
    ((6, 40, 24), (2, 2), ("S0", "S0"), True),  # experts (expert parallel x FSDP2): whole rows
    ((5, 3, 32), (2,), ("S1",), True),  # 3-D, pieces of 2 x 32 and 1 x 32: the scales shard the same way
    ((5, 5, 64), (2,), ("S1",), False),  # groups 6 + 4, but the scales of 10 groups chunk 5 + 5
    ((4, 3, 64), (2,), ("S2",), False),  # whole groups 0, 2, 4 on rank 0: no DTensor of the scales holds those
    ((4, 3, 64), (2, 2), ("S1", "S2"), False),  # two dims inside the row
    ((40,), (4,), ("S0",), True),  # 1-D: elementwise state
    ((48, 128), (2, 2, 2), ("R", "S0", "S1"), True),  # HSDP x TP
    ((48, 96), (2, 2, 2), ("R", "S0", "S1"), False),
    ((5, 3, 32), (4,), ("S1",), True),  # pieces of 32, 32, 32 and an empty one; the scales chunk 1, 1, 1, 0
    ((6, 40, 24), (2, 2), ("S1", "S0"), True),  # experts on ep, FSDP2 on dim 1: pieces of 20 x 24 = 15 groups
], ids=lambda v: str(v).replace(" ", ""))
def test_placement_rule(shape, mesh_shape, placements, accepted):
    from torch.distributed.tensor import Replicate

    placements = tuple(Replicate() if p == "R" else _shard(int(p[1])) for p in placements)
    problem = placement_problem(shape, mesh_shape, placements, GROUP)
    assert (problem is None) == accepted, problem
    assert placement_problem(shape, mesh_shape, placements, None) is None  # fp32 moments: any shard


def test_strided_shard_rule():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP2 over a RowwiseParallel dim-1 shard (shard_placement_fn=Shard(1)): 128 -> 64 -> 32 each, interleaved
    assert placement_problem((8, 128), (2, 2), (_StridedShard(1, split_factor=2), Shard(1)), GROUP) is None
    assert placement_problem((8, 96), (2, 2), (_StridedShard(1, split_factor=2), Shard(1)), GROUP) is not None
    assert placement_problem((9, 40), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), GROUP) is None


# ----- refusals through the optimizer, on 4 ranks -----------------------------------------------------------


def _refusals(rank, world_size):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = _mesh((1, 4))
    errors = {}
    model = nn.Sequential(nn.Linear(96, 8)).to(torch.bfloat16)
    parallelize_module(model, mesh["tp"], {"0": RowwiseParallel()})
    try:
        make_optimizer(model)
    except ValueError as e:
        errors["rowwise-96"] = str(e)
    FlashAdamW(model.parameters(), quantize_states=False, backend="reference")  # elementwise state: accepted

    model = nn.Module()
    model.weight = nn.Parameter(distribute_tensor(torch.zeros(4, 3, 128, dtype=torch.bfloat16), mesh["tp"],
                                                  [Shard(2)], src_data_rank=None))
    try:
        make_optimizer(model)
    except ValueError as e:
        errors["shard2"] = str(e)

    # a Partial gradient left by tensor parallelism keeps its error, and the step changes nothing
    model = parallelize(make_block(), mesh)
    optimizer = make_optimizer(model)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    set_grads(model, global_grads(0))
    wo = model.attention.wo.weight
    wo.grad = DTensor.from_local(wo.grad.to_local(), wo.device_mesh, [wo.placements[0], Partial()],
                                 run_check=False, shape=wo.shape, stride=wo.stride())
    try:
        optimizer.step()
    except RuntimeError as e:
        errors["partial-grad"] = str(e)
    assert all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters()), "a refused step stepped"
    return errors


def test_refusals_name_the_parameter_and_the_fix():
    errors = run_ranks(_refusals, 4, timeout=120)[0]
    assert "'0.weight'" in errors["rowwise-96"] and "Shard(dim=1)" in errors["rowwise-96"], errors
    assert "cut quantization groups" in errors["rowwise-96"] and "n in [1, 3]" in errors["rowwise-96"], errors
    assert "'weight'" in errors["shard2"] and "not the DTensor shard of the scales" in errors["shard2"], errors
    assert "'attention.wo.weight'" in errors["partial-grad"] and "Partial(sum)" in errors["partial-grad"], errors


# ----- launch/train.py --tp ---------------------------------------------------------------------------------


def _train_py(tmp_path, name: str, *extra: str) -> list[dict]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    tiny = ["--d-model", "64", "--n-layer", "1", "--n-head", "2", "--seq-len", "32", "--batch-size", "2",
            "--corpus-mb", "1", "--eval-every", "100", "--eval-batches", "1", "--log-every", "1", "--warmup", "1",
            "--threads", "1", "--same-batch", "--compute-dtype", "fp32", "--ckpt-dir", str(tmp_path / "ck"),
            "--ckpt-every", "2", "--out-dir", str(tmp_path / name)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(root / "launch" / "train.py"), *tiny, *extra]
    done = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [__import__("json").loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]


def test_train_py_tp2_matches_fsdp2_and_resumes_under_fsdp2(tmp_path):
    """--tp 2 (proj/down rows of 64 and 256 values: 32 and 128 per rank) trains like FSDP2 on the same
    batches (not bit for bit: a row-parallel matmul adds its halves in another order), and its checkpoint
    resumes under FSDP2."""
    tp = _train_py(tmp_path, "tp", "--tp", "2", "--steps", "2")
    (tmp_path / "ck").rename(tmp_path / "ck-tp")
    fsdp = _train_py(tmp_path, "fsdp", "--steps", "2")
    for a, b in zip(tp, fsdp):
        assert abs(a["loss"] - b["loss"]) < 0.02 * b["loss"], (tp, fsdp)
    (tmp_path / "ck").rename(tmp_path / "ck-fsdp")
    (tmp_path / "ck-tp").rename(tmp_path / "ck")
    resumed = _train_py(tmp_path, "resumed", "--steps", "3", "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[:2] == tp
