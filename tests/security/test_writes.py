"""Writes never touch what flashdist did not write: planted symbolic links at lock and temporary paths are
refused or ignored, never followed; user folders and files with checkpoint-like names are never deleted or
replaced; outputs get the umask's modes; a full disk is one line that says so, with nothing half-written."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from pathlib import Path

import pytest
import torch

import flashdist
from flashdist import checkpoint
from flashdist.checkpoint import dcp_files, output
from flashdist.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def _one_line(rc, out, err, *needles):
    assert rc == 1 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    for needle in needles:
        assert needle in err, (needle, err)


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32).to(torch.bfloat16)
    return model, flashdist.FlashAdamW(model.parameters())


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "ck"
    checkpoint.save(path, *_model_opt(), extra={"n": 1})
    return path


# ----- planted symbolic links -------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["link-to-missing", "link-to-file", "fifo", "folder"])
def test_save_refuses_a_planted_lock_file_and_creates_nothing_through_it(tmp_path, planted):
    victim = tmp_path / "victim"
    victim.mkdir()
    lock = tmp_path / "ck.flashdist-lock"
    if planted == "link-to-missing":
        lock.symlink_to(victim / "created")
    elif planted == "link-to-file":
        (victim / "file").write_text("theirs")
        lock.symlink_to(victim / "file")
    elif planted == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="lock file .*(symbolic link|not a regular file).*remove it") \
            as info:
        checkpoint.save(tmp_path / "ck", *_model_opt())
    assert len(str(info.value).splitlines()) == 1
    assert _tree(victim) == ({"file": b"theirs"} if planted == "link-to-file" else {})
    assert sorted(os.listdir(tmp_path)) == ["ck.flashdist-lock", "victim"]  # nothing written, the plant kept
    rc, out, err = cli("clean", tmp_path / "ck")
    _one_line(rc, out, err, "ck.flashdist-lock")


def test_planted_links_at_leftover_names_are_never_followed(tmp_path, source):
    """Links named like a save's temporary folder or an output's temporary file, pointing at someone's files:
    neither a save, a convert nor clean follows or removes them."""
    victim = tmp_path / "victim"
    checkpoint.save(victim / "ck", *_model_opt())
    (victim / "out.pt").write_bytes(b"PK\x03\x04theirs")
    before = _tree(victim)
    (tmp_path / f"ck.tmp-{'a' * 32}").symlink_to(victim / "ck")
    (tmp_path / "ck.old").symlink_to(victim / "ck")
    (tmp_path / ".out.pt.abcd1234.tmp").symlink_to(victim / "out.pt")
    (tmp_path / ".out.pt.abcd1234.old").symlink_to(victim / "out.pt")
    with pytest.raises(checkpoint.CheckpointError, match="ck.old is a symbolic link"):
        checkpoint.save(tmp_path / "ck", *_model_opt())
    (tmp_path / "ck.old").unlink()
    checkpoint.save(tmp_path / "ck", *_model_opt())
    assert cli("convert", source, tmp_path / "out.pt", "--to", "torch")[0] == 0
    rc, out, _ = cli("clean", tmp_path / "ck")
    assert rc == 0 and "kept" in out
    assert _tree(victim) == before
    assert {p.name for p in tmp_path.iterdir() if p.is_symlink()} == {
        f"ck.tmp-{'a' * 32}", ".out.pt.abcd1234.tmp", ".out.pt.abcd1234.old"}


def test_temporary_output_is_created_without_following_a_planted_link(tmp_path, source, monkeypatch):
    """A link planted at the very name a run draws for its temporary file: the run draws another name."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / ".out.pt.deadbeef.tmp").symlink_to(victim / "created")
    names = iter(["deadbeef", "0123abcd"])
    monkeypatch.setattr(output.secrets, "token_hex", lambda n: next(names))
    assert cli("convert", source, tmp_path / "out.pt", "--to", "torch")[0] == 0
    assert list(victim.iterdir()) == [] and (tmp_path / ".out.pt.deadbeef.tmp").is_symlink()


# ----- never delete what flashdist did not write ------------------------------------------------------------


USER_ENTRIES = {  # checkpoint-like names that are not what flashdist writes: (name, what)
    "notes.distcp-folder": ("notes.distcp", "folder"),
    "metadata-folder": (".metadata", "folder"),
    "shard-folder": ("__0_0.distcp", "folder"),
    "config.json-folder": ("config.json", "folder"),
    "metadata-text": (".metadata", "text"),
    "shard-text": ("__0_0.distcp", "text"),
    "metadata-link": (".metadata", "link"),
}


def _plant(folder: Path, entry: str) -> None:
    """The user's entry in ``folder``, in place of a file of that name flashdist wrote there, if any."""
    name, what = USER_ENTRIES[entry]
    target = folder / name
    if target.is_file() and not target.is_symlink():
        target.unlink()
    if what == "folder":
        target.mkdir()
        (target / "mine.txt").write_text("keep")
    elif what == "text":
        target.write_text("my notes")
    else:
        target.symlink_to("/etc/hostname")


@pytest.mark.parametrize("entry", list(USER_ENTRIES))
def test_save_never_deletes_user_entries_with_checkpoint_names(tmp_path, entry):
    folder = tmp_path / "ck"
    checkpoint.save(folder, *_model_opt())
    _plant(folder, entry)
    before = _tree(folder)
    with pytest.raises(checkpoint.CheckpointError, match="not part of a checkpoint") as info:
        checkpoint.save(folder, *_model_opt())
    assert USER_ENTRIES[entry][0] in str(info.value)
    assert _tree(folder) == before and sorted(os.listdir(tmp_path)) == ["ck"]


@pytest.mark.parametrize("entry", list(USER_ENTRIES))
def test_dead_save_folder_holding_user_entries_is_kept(tmp_path, entry):
    dead = tmp_path / f"ck.tmp-{'b' * 32}"
    dead.mkdir()
    (dead / ".flashdist-writing").touch()
    _plant(dead, entry)
    before = _tree(dead)
    checkpoint.save(tmp_path / "ck", *_model_opt())
    rc, out, _ = cli("clean", tmp_path / "ck")
    assert rc == 0 and out.startswith("kept") and "flashdist does not write" in out, out
    assert _tree(dead) == before


@pytest.mark.parametrize("entry", list(USER_ENTRIES))
@pytest.mark.parametrize("args", [("convert", "--to", "dcp"), ("export", "--hf")], ids=["dcp", "hf"])
def test_force_never_replaces_a_folder_with_user_entries(tmp_path, source, entry, args):
    dst = tmp_path / "out"
    assert cli(args[0], source, dst, *args[1:])[0] == 0
    _plant(dst, entry)
    before = _tree(dst)
    _one_line(*cli(args[0], source, dst, *args[1:], "--force"), "--force replaces only", str(dst))
    assert _tree(dst) == before and sorted(os.listdir(tmp_path)) == ["out"]


def test_user_file_named_like_a_temporary_output_is_kept(tmp_path, source):
    (tmp_path / ".out.pt.abcd1234.tmp").write_text("my notes, named oddly")
    assert cli("convert", source, tmp_path / "out.pt", "--to", "torch")[0] == 0
    rc, out, _ = cli("clean", tmp_path / "out.pt")
    assert out.startswith("kept") and (tmp_path / ".out.pt.abcd1234.tmp").read_text() == "my notes, named oddly"


def test_previous_outputs_are_still_replaced_with_force(tmp_path, source):
    for args in (("convert", "--to", "dcp"), ("export", "--hf"), ("convert", "--to", "torch"), ("export",)):
        dst = tmp_path / "-".join(args)
        assert cli(args[0], source, dst, *args[1:])[0] == 0
        rc, _, err = cli(args[0], source, dst, *args[1:], "--force")
        assert rc == 0, err
    assert len(os.listdir(tmp_path)) == 4


# ----- modes ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_outputs_get_the_modes_save_gives(tmp_path, source, mask):
    with _umask(mask):
        checkpoint.save(tmp_path / "saved", *_model_opt())
        for name, args in {"dcp": ("convert", "--to", "dcp"), "pt": ("convert", "--to", "torch"),
                           "st": ("convert", "--to", "safetensors"), "w": ("export",), "hf": ("export", "--hf")
                           }.items():
            assert cli(args[0], source, tmp_path / name, *args[1:])[0] == 0
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    for name, mode in modes.items():
        want = (0o777 if (tmp_path / name).is_dir() else 0o666) & ~mask
        assert mode == want, (name, oct(mode), oct(want))
    assert {"saved", "dcp", "pt", "st", "w", "hf", "hf/model.safetensors", "dcp/.metadata"} <= set(modes)


# ----- a full disk ------------------------------------------------------------------------------------------


class _FullDisk(io.RawIOBase):
    """A file whose writes past ``room`` bytes fail with ENOSPC."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, b):
        if self.real.tell() + len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real.write(b)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


@pytest.mark.parametrize("args", [("convert", "--to", "safetensors"), ("export",), ("export", "--hf")],
                         ids=["safetensors", "export", "export-hf"])
def test_disk_full_while_writing_safetensors_is_one_line(tmp_path, source, args, monkeypatch):
    dst = tmp_path / "out"
    assert cli(args[0], source, dst, *args[1:])[0] == 0
    before = _tree(dst) if dst.is_dir() else dst.read_bytes()
    monkeypatch.setattr(output, "open", lambda path, mode: _FullDisk(open(path, mode), 600), raising=False)
    _one_line(*cli(args[0], source, dst, *args[1:], "--force"), "could not write", str(dst), "the disk is full")
    assert (_tree(dst) if dst.is_dir() else dst.read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("free,said", [(0, "the disk is full"), (1 << 40, "the write failed")], ids=["full", "other"])
def test_torch_zip_writer_failure_says_the_disk_is_full(tmp_path, source, monkeypatch, free, said):
    """torch's zip writer reports a full disk as 'unexpected pos 704 vs 598'; the free space decides the words."""
    import shutil

    def failing_save(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(output.torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 41, (1 << 41) - free, free))
    _one_line(*cli("convert", source, tmp_path / "out.pt", "--to", "torch"), "could not write", said,
              "unexpected pos")
    assert os.listdir(tmp_path) == []


def test_disk_full_in_a_dcp_write_is_one_line(tmp_path, source, monkeypatch):
    def full(self, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_files._ShardStream, "write", full)
    _one_line(*cli("convert", source, tmp_path / "out", "--to", "dcp"), "could not write", "the disk is full")
    assert os.listdir(tmp_path) == []
    with pytest.raises(checkpoint.CheckpointWriteError, match="the disk is full") as info:
        checkpoint.save(tmp_path / "ck", *_model_opt())
    assert len(str(info.value).splitlines()) == 1 and os.listdir(tmp_path) == []


def test_clean_keeps_what_a_live_writer_holds(tmp_path):
    """A temporary output or a save folder whose lock a running process holds is listed as kept, not removed."""
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX")
    temp = tmp_path / ".out.pt.abcd1234.tmp"
    temp.write_bytes(b"PK\x03\x04partial")
    live = tmp_path / f"out.pt.tmp-{'d' * 32}"
    live.mkdir()
    (live / ".flashdist-writing").touch()
    fds = [os.open(temp, os.O_RDONLY), os.open(live / ".flashdist-writing", os.O_RDWR)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX)
        rc, out, _ = cli("clean", tmp_path / "out.pt")
        assert rc == 0 and out.count("kept") == 2 and "live" in out, out
        assert temp.exists() and live.exists()
    finally:
        for fd in fds:
            os.close(fd)
    rc, out, _ = cli("clean", tmp_path / "out.pt")
    assert out.count("removed") == 2 and os.listdir(tmp_path) == []
