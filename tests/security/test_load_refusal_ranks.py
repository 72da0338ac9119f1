"""A checkpoint that does not fit the optimizer it is loaded into is refused with CheckpointError (a
ValueError, for callers written before) on every rank, with the model and optimizer unchanged; a save that
fails on one rank before writing fails on every rank, in one line, with nothing left behind."""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from torch import nn

import flashdist
from flashdist import checkpoint


def _build(bits: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3)).to(torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, flashdist.FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=bits)


def _save_24_load_32(rank: int, world: int, folder: str) -> list[str]:
    model, opt = _build(24)
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    checkpoint.save(folder, model, opt)
    model, opt = _build(32)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    try:
        checkpoint.load(folder, model, opt)
    except checkpoint.CheckpointError as e:
        assert isinstance(e, ValueError)
        after = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the model"
        return [type(e).__name__, str(e)]
    return ["loaded", ""]


@pytest.mark.slow
def test_24_bit_checkpoint_into_32_bit_optimizer_is_a_checkpoint_error_on_every_rank(tmp_path):
    results = run_ranks(_save_24_load_32, 2, str(tmp_path / "ck"), timeout=120)
    for kind, message in results:
        assert kind == "CheckpointError", results
        assert str(tmp_path / "ck") in message and "\n" not in message


def _one_rank_cannot_build_its_state(rank: int, world: int, folder: str) -> list[str]:
    model, opt = _build(24)
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    if rank == 1:  # as an out-of-memory while the state dict is built would
        def fail(*args, **kwargs):
            raise MemoryError("no memory left while building the state dict")

        opt.state_dict = fail
    try:
        checkpoint.save(folder, model, opt)
    except checkpoint.CheckpointWriteError as e:
        return [type(e).__name__, str(e)]
    return ["saved", ""]


@pytest.mark.slow
def test_a_save_that_one_rank_cannot_build_fails_on_every_rank_without_waiting(tmp_path):
    """Rank 1 fails while building its state dict, before any rank writes: every rank hears of it before
    entering DCP's save (which would otherwise wait for rank 1 forever) and raises the same one line."""
    results = run_ranks(_one_rank_cannot_build_its_state, 2, str(tmp_path / "ck"), timeout=120)
    for kind, message in results:
        assert kind == "CheckpointWriteError", results
        assert "reading the model's and optimizer's state failed (MemoryError" in message and "\n" not in message
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
