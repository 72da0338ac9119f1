"""A save on 2 gloo ranks (FSDP2) with one rank or both killed (SIGKILL) at each phase: the previous
checkpoint at the path still loads bit-exactly, what the dead save left never loads partly (it is refused,
or it is the whole new checkpoint: killed after the last shard), and ``flashdist clean`` (or the next save)
leaves nothing else beside the path.

Each case is one spawn of 2 ranks: both save the checkpoint n=1, then save n=2 with the kill point patched in
on the victim ranks (the hook of test_fault_windows)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness import RankFailure, run_ranks
from test_fault_windows import SAVE_PHASES, _die_at, cli

import flashdist
from flashdist import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(shard: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 4)).to(torch.bfloat16)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model


def _save(path: str, n: int, model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(n)
    checkpoint.save(path, model, flashdist.FlashAdamW(model.parameters()), extra={"n": n})


def _saves(rank: int, world: int, path: str, victims: tuple, kill: tuple) -> None:
    import torch.distributed as dist

    _save(path, 1, _model(shard=True))
    dist.barrier()
    if rank in victims:
        target, match, when = kill
        _die_at(target, path if match == "PATH" else match, when)
    _save(path, 2, _model(shard=True))


def _expected(n: int) -> dict[str, torch.Tensor]:
    model = _model(shard=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(n)
    return model.state_dict()


def _load(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model = _model(shard=False)
    extra = checkpoint.load(path, model, flashdist.FlashAdamW(model.parameters()))
    return extra["n"], model.state_dict()


CASES = {  # name: (victim ranks, kill point, the checkpoint PATH holds after the kill)
    "rank1-writing-shards": ((1,), SAVE_PHASES["writing-shards"], 1),
    "both-writing-shards": ((0, 1), SAVE_PHASES["writing-shards"], 1),
    "rank0-writer-lock-unlinked": ((0,), SAVE_PHASES["writer-lock-unlinked"], 1),
    "rank0-between-renames": ((0,), ("os:replace", "PATH", "after"), 1),
    "rank0-before-old-removed": ((0,), SAVE_PHASES["before-old-removed"], 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_killed_rank_leaves_the_previous_checkpoint_and_clean_removes_the_rest(tmp_path, case):
    victims, kill, after = CASES[case]
    path = tmp_path / "ck"
    with pytest.raises(RankFailure) as failure:
        run_ranks(_saves, 2, str(path), victims, kill, timeout=60)
    if 0 in victims:  # (rank 1 alone: rank 0 reports first, failing the collective rank 1 left)
        assert "rank 0 died with exit code -9" in str(failure.value), str(failure.value)
    n, state = _load(path)  # at once: PATH, or PATH.old between the renames
    assert n == after
    expected = _expected(after)
    assert all(torch.equal(state[k], expected[k]) for k in expected), "the checkpoint's tensors changed"
    for left in tmp_path.iterdir():  # what the dead save left: refused, or whole (every shard and .metadata)
        if left.name not in ("ck", "ck.old"):
            try:
                n, state = _load(left)
            except checkpoint.CheckpointError:
                continue
            assert n == 2 and all(torch.equal(state[k], v) for k, v in _expected(2).items()), left.name
    rc, out, err = cli("clean", path)
    assert rc == 0 and err == "", err
    assert sorted(os.listdir(tmp_path)) == ["ck"], out
    n, state = _load(path)
    assert n == after and all(torch.equal(state[k], expected[k]) for k in expected)


def test_next_save_removes_what_killed_ranks_left(tmp_path):
    """Rank 0 killed after the writer lock went (the full PATH.tmp-<id> the issue found surviving later saves):
    the next save, in one process here, removes it and PATH holds the new checkpoint alone."""
    path = tmp_path / "ck"
    victims, kill, _ = CASES["rank0-writer-lock-unlinked"]
    with pytest.raises(RankFailure):
        run_ranks(_saves, 2, str(path), victims, kill, timeout=60)
    assert len(os.listdir(tmp_path)) > 1
    _save(str(path), 3, _model(shard=False))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    n, state = _load(path)
    assert n == 3 and all(torch.equal(state[k], v) for k, v in _expected(3).items())
