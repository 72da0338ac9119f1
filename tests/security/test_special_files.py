"""Only regular files are read: a FIFO, a device or a directory where a checkpoint file is expected is refused
in one line naming it, at once (a FIFO read would block forever: each read here runs under a deadline)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from _hostile import READERS, attempt, copy_checkpoint, saved, within

from tests._cli import run_cli

DEADLINE = 20.0


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return saved(tmp_path_factory.mktemp("good") / "ck")


def _replace(path: Path, kind: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"x")


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("which", [".metadata", "shard"])
def test_special_file_in_a_dcp_folder_is_refused_at_once(good, tmp_path, which, kind, reader):
    folder = copy_checkpoint(good, tmp_path / "ck")
    target = folder / ".metadata" if which == ".metadata" else next(folder.glob("*.distcp"))
    _replace(target, kind)
    error = within(DEADLINE, attempt, reader, folder, tmp_path / "out", release=target if kind == "fifo" else None)
    assert error is not None and target.name in str(error), error
    assert ("a FIFO" if kind == "fifo" else "a directory") in str(error), error
    assert not (tmp_path / "out").exists()


def test_device_is_refused_even_when_links_out_are_allowed(good, tmp_path, monkeypatch):
    folder = copy_checkpoint(good, tmp_path / "ck")
    shard = next(folder.glob("*.distcp"))
    shard.unlink()
    shard.symlink_to("/dev/zero")
    assert "outside" in str(within(DEADLINE, attempt, "load", folder, tmp_path / "out"))
    monkeypatch.setenv("FLASHDIST_FOLLOW_LINKS", "1")
    assert "character device" in str(within(DEADLINE, attempt, "inspect", folder, tmp_path / "out"))


@pytest.mark.parametrize("reader", ["inspect", "convert", "export"])
def test_fifo_named_on_the_command_line_is_refused_at_once(tmp_path, reader):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    error = within(DEADLINE, attempt, reader, fifo, tmp_path / "out", release=fifo)
    assert "a FIFO" in str(error), error


@pytest.mark.parametrize("which", ["latest", "mp_rank_00_model_states.pt"])
def test_fifo_in_a_deepspeed_folder_is_refused_at_once(tmp_path, which):
    folder = tmp_path / "ds"
    (folder / "step1").mkdir(parents=True)
    torch.save({}, folder / "step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    target = folder / "latest" if which == "latest" else folder / "step1" / which
    if which != "latest":
        (folder / "latest").write_text("step1")
    os.mkfifo(target)
    for reader in ("inspect", "convert"):
        error = within(DEADLINE, attempt, reader, folder, tmp_path / "out", release=target)
        assert "a FIFO" in str(error) and target.name in str(error), error


def test_fifo_as_the_exported_config_is_refused_at_once(good, tmp_path):
    config = tmp_path / "config.json"
    os.mkfifo(config)
    rc, _, err = within(DEADLINE, lambda: run_cli("export", good, tmp_path / "hf", "--hf", "--config", config),
                        release=config)
    assert rc == 1 and "a FIFO" in err and not (tmp_path / "hf").exists(), err
