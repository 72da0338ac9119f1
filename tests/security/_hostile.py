"""Hostile checkpoint files for the tests of this folder, built from small real ones, and the deadline under
which a read that might block (a FIFO) is run."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import flashdist
from flashdist import checkpoint
from tests._cli import run_cli

READERS = ("load", "inspect", "convert", "export")


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).to(torch.bfloat16)
    return model, flashdist.FlashAdamW(model.parameters(), lr=1e-2)


def saved(folder: Path) -> Path:
    """A checkpoint written by flashdist.checkpoint.save (shards tied to their .metadata) at ``folder``."""
    model, opt = model_and_optimizer()
    model(torch.randn(4, 6, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    checkpoint.save(folder, model, opt, extra={"note": "victim"})
    return folder


def plain(folder: Path, state: dict | None = None) -> Path:
    """A checkpoint written by plain dcp.save (no save ids in its .metadata: accepted for compatibility)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state if state is not None else {"x": torch.arange(6.0), "l": [{"a": torch.ones(2)}, {"b": 1}]},
                 checkpoint_id=str(folder), no_dist=True)
    return folder


def metadata_of(folder: Path):
    with open(folder / ".metadata", "rb") as f:  # our own file, written just now: plain pickle is fine here
        return pickle.load(f)


def write_metadata(folder: Path, metadata) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def retarget(metadata, rename) -> None:
    """Point every storage record of ``metadata`` at ``rename(relative_path)``."""
    for info in metadata.storage_data.values():
        info.relative_path = rename(info.relative_path)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def attempt(reader: str, path: Path, out: Path):
    """Read ``path`` the way ``reader`` does; returns None on success or the CheckpointError. Any other
    exception propagates (the test fails on it). The CLI readers must fail in one line, exit status 1."""
    if reader == "load":
        model, opt = model_and_optimizer(seed=5)
        try:
            checkpoint.load(path, model, opt)
        except checkpoint.CheckpointError as e:
            assert "\n" not in str(e), str(e)
            return e
        return None
    args = {"inspect": ("inspect", path), "convert": ("convert", path, out, "--to", "torch"),
            "export": ("export", path, out)}[reader]
    rc, stdout, stderr = run_cli(*args)
    if rc == 0:
        return None
    assert rc == 1 and stderr.count("\n") == 1 and "Traceback" not in stderr, (rc, stdout, stderr)
    assert "set FLASHDIST_TRACEBACK" not in stderr, stderr  # an error nobody foresaw is not a refusal
    return checkpoint.CheckpointError(stderr.strip())


def within(seconds: float, fn, *args, release: Path | None = None):
    """``fn(*args)`` in a daemon thread; fails the test if it has not returned after ``seconds`` (a read
    blocked on a FIFO: ``release`` opens that FIFO for writing so the thread can end)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if release is not None:
            with contextlib.suppress(OSError):
                os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} still running after {seconds} s (blocked?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")
