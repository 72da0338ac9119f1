"""Nothing outside the folder named is read: the names a checkpoint holds (DCP shard paths, DeepSpeed tags and
files) resolve inside it, through every reader (checkpoint.load, flashdist inspect | convert | export), for
checkpoints with save ids and without (plain DCP). Symbolic links inside the folder are fine; links out of it
only under FLASHDIST_FOLLOW_LINKS=1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _hostile import READERS, attempt, copy_checkpoint, metadata_of, plain, retarget, saved, write_metadata

from flashdist import checkpoint
from flashdist.checkpoint import sources
from tests._cli import run_cli


@pytest.fixture(scope="module")
def victims(tmp_path_factory) -> dict[str, Path]:
    """A flashdist checkpoint and a plain DCP one, in a folder of their own ("outside")."""
    root = tmp_path_factory.mktemp("outside")
    return {"tied": saved(root / "tied"), "plain": plain(root / "plain")}


def _crafted(tmp_path: Path, victim: Path, how: str) -> Path:
    """A folder holding only a .metadata (the victim's) whose shard names lead to the victim's shards."""
    md = metadata_of(victim)
    folder = tmp_path / "crafted"
    folder.mkdir(parents=True)
    if how == "dotdot":
        retarget(md, lambda name: f"../../{victim.parent.name}/{victim.name}/{name}")
        assert all((folder / i.relative_path).exists() for i in md.storage_data.values())
    elif how == "absolute":
        retarget(md, lambda name: str(victim / name))
    elif how == "symlink":
        for name in {i.relative_path for i in md.storage_data.values()}:
            (folder / name).symlink_to(victim / name)
    return write_metadata(folder, md)


# a plain DCP checkpoint holds no flashdist model to load or export: inspect and convert read it
CASES = [(victim, reader) for victim in ("tied", "plain") for reader in READERS
         if victim == "tied" or reader in ("inspect", "convert")]


@pytest.mark.parametrize(("victim", "reader"), CASES, ids=[f"{v}-{r}" for v, r in CASES])
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_names_leading_out_of_the_folder_are_refused(victims, tmp_path, how, victim, reader):
    folder = _crafted(tmp_path, victims[victim], how)
    error = attempt(reader, folder, tmp_path / "out")
    assert error is not None, f"{reader} read the shards of {victims[victim]} through {folder}"
    assert "outside" in str(error) and str(folder) in str(error), error
    assert not (tmp_path / "out").exists()


def test_metadata_linked_from_elsewhere_is_refused(victims, tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").symlink_to(victims["tied"] / ".metadata")
    assert "outside" in str(attempt("load", folder, tmp_path / "out"))


def test_links_inside_the_folder_still_load(victims, tmp_path):
    folder = copy_checkpoint(victims["tied"], tmp_path / "ck")
    (folder / "store").mkdir()
    for shard in folder.glob("*.distcp"):
        shard.rename(folder / "store" / shard.name)
        shard.symlink_to(Path("store") / shard.name)
    assert attempt("load", folder, tmp_path / "out") is None
    assert attempt("convert", folder, tmp_path / "out.pt") is None


def test_links_out_load_when_the_user_opts_in(victims, tmp_path, monkeypatch):
    folder = _crafted(tmp_path, victims["tied"], "symlink")
    monkeypatch.setenv("FLASHDIST_FOLLOW_LINKS", "1")
    assert attempt("load", folder, tmp_path / "out") is None
    # '..' and absolute names stay refused: the opt-in is about links the user put there
    retargeted = _crafted(tmp_path / "b", victims["tied"], "absolute")
    assert "outside" in str(attempt("load", retargeted, tmp_path / "out"))


# ----- DeepSpeed folders ---------------------------------------------------------------------------------


def _deepspeed_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ds"
    (folder / "step1").mkdir(parents=True)
    torch.save({"optimizer_state_dict": {}}, folder / "step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return folder


def test_deepspeed_latest_linked_to_another_file_is_refused_without_echoing_it(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("step1")  # a plausible tag, and still not read: the link leads out
    folder = _deepspeed_folder(tmp_path)
    (folder / "latest").symlink_to(secret)
    for reader in ("inspect", "convert", "export"):
        error = attempt(reader, folder, tmp_path / "out")
        assert "outside" in str(error) and "latest" in str(error), error


@pytest.mark.parametrize("content", [b"password=hunter2 token=abc", b"\xff\xfe binary \x00 junk", b"step1\nstep2",
                                     b"x" * 5000])
def test_deepspeed_latest_that_is_not_a_tag_is_refused_without_echoing_it(tmp_path, content):
    folder = _deepspeed_folder(tmp_path)
    (folder / "latest").write_bytes(content)
    error = attempt("inspect", folder, tmp_path / "out")
    assert error is not None and "latest" in str(error)
    for word in (b"hunter2", b"junk", b"step2", b"xxxxxxxx"):
        assert word.decode() not in str(error), error


@pytest.mark.parametrize("tag", ["../elsewhere", "/etc", "link"])
def test_deepspeed_tags_leading_out_are_refused(tmp_path, tag):
    folder = _deepspeed_folder(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    (folder / "latest").write_text(tag)
    assert "outside" in str(attempt("convert", folder, tmp_path / "out"))
    rc, _, err = run_cli("convert", folder, tmp_path / "out", "--to", "dcp", "--tag", tag)
    assert rc == 1 and "outside" in err


def test_deepspeed_files_linked_from_elsewhere_are_refused(tmp_path):
    folder = _deepspeed_folder(tmp_path)
    (folder / "latest").write_text("step1")
    torch.save({"module": {}}, folder / "step1" / "mp_rank_00_model_states.pt")
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
        (folder / "step1" / name).rename(tmp_path / name)
        (folder / "step1" / name).symlink_to(tmp_path / name)
    for reader in ("inspect", "convert", "export"):
        error = attempt(reader, folder, tmp_path / "out")
        assert "outside" in str(error) and "step1" in str(error), error


def test_plain_dcp_reader_api_refuses_too(victims, tmp_path):
    """flashdist.checkpoint.sources.read (the library function behind convert) refuses as the CLI does."""
    folder = _crafted(tmp_path, victims["plain"], "dotdot")
    with pytest.raises(checkpoint.CheckpointError, match="outside"):
        sources.read(folder)
    assert not os.path.exists(tmp_path / "out")


def test_names_with_control_characters_are_printed_escaped(victims, tmp_path):
    """A crafted name cannot carry terminal control sequences into the error message."""
    md = metadata_of(victims["plain"])
    retarget(md, lambda name: "\x1b[2J\x1b]0;owned\x07" + name)
    folder = write_metadata(tmp_path / "ck", md)
    error = attempt("inspect", folder, tmp_path / "out")
    assert error is not None and "\x1b" not in str(error) and "\x07" not in str(error), repr(error)
    assert "\\x1b" in str(error), repr(error)


@pytest.mark.parametrize("linked", ["model.safetensors", "optimizer.bin", "config.json"])
def test_trainer_and_accelerate_folder_files_linked_from_elsewhere_are_refused(tmp_path, linked):
    """A Trainer / Accelerate folder's weight or optimizer file that is a link out of the folder: refused in one
    line by inspect and export, naming the link. A model config linked out is not read (the model's order is
    then unknown, said why; here the optimizer's param_names do not need it)."""
    from safetensors.torch import save_file

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    folder = tmp_path / "state"
    folder.mkdir()
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(outside / "model.safetensors"))
    torch.save({"state": {}, "param_groups": [{"params": [], "param_names": []}]}, outside / "optimizer.bin")
    (outside / "config.json").write_text('{"model_type": "gpt2"}')
    for name in ("model.safetensors", "optimizer.bin", "config.json"):
        if name == linked:
            os.symlink(outside / name, folder / name)
        else:
            os.link(outside / name, folder / name)
    if linked == "config.json":  # a config that is not this model's, were it read
        (outside / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 1000000}')
    for command in (("inspect", folder), ("export", folder, tmp_path / "out.safetensors")):
        rc, out, err = run_cli(*command)
        if linked == "config.json":
            assert rc == 0 and "1,000,000" not in out + err, (rc, out, err)
            continue
        assert rc == 1 and err.count("\n") == 1 and "symbolic link that leads outside" in err, err
        assert str(folder / linked) in err, err


@pytest.mark.parametrize("how", ["tag-dotdot", "zero-link-out", "param-link-out"])
def test_universal_checkpoint_reads_stay_inside_the_folder(tmp_path, how):
    """flashdist.integrations.deepspeed.load_checkpoint reads the 24-bit masters of a universal checkpoint at
    ``load_dir/<tag>/zero/<param>/fp32.pt``: a latest_universal tag with ``..``, a ``zero`` folder or a
    parameter folder that links out of ``load_dir`` is refused in one line, nothing read."""
    pytest.importorskip("deepspeed")
    from flashdist.integrations import deepspeed as fds

    outside = tmp_path / "outside" / "step1_universal" / "zero" / "w"
    outside.mkdir(parents=True)
    torch.save({"param": torch.ones(3)}, outside / "fp32.pt")
    load_dir = tmp_path / "ck"
    (load_dir / "step1_universal" / "zero").mkdir(parents=True)
    (load_dir / "latest_universal").write_text("step1_universal")
    if how == "tag-dotdot":
        (load_dir / "latest_universal").write_text("../outside/step1_universal")
    elif how == "zero-link-out":
        (load_dir / "step1_universal" / "zero").rmdir()
        (load_dir / "step1_universal" / "zero").symlink_to(outside.parent)
    else:
        (load_dir / "step1_universal" / "zero" / "w").symlink_to(outside)
    with pytest.raises(checkpoint.CheckpointError) as e:
        zero = fds.universal_folder(str(load_dir))
        fds._read_universal(zero, "w")
    assert "\n" not in str(e.value) and str(load_dir) in str(e.value), str(e.value)
    if how == "param-link-out":  # the same folder with the parameter's files inside it reads
        (load_dir / "step1_universal" / "zero" / "w").unlink()
        (load_dir / "step1_universal" / "zero" / "w").mkdir()
        torch.save({"param": torch.ones(3)}, load_dir / "step1_universal" / "zero" / "w" / "fp32.pt")
        assert torch.equal(fds._read_universal(fds.universal_folder(str(load_dir)), "w"), torch.ones(3))


@pytest.mark.parametrize("linked", [".metadata", "shard"])
def test_hard_links_to_files_outside_are_refused_without_printing_them(victims, tmp_path, linked):
    """A hard link cannot be told from the folder's own file: a .metadata hard-linked to a text file outside is
    refused as damaged, a shard of a flashdist checkpoint hard-linked to one lacks the save's id; no reader
    prints what the linked file holds."""
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("ssh-rsa AAAASECRET user@host\n" * 40)
    folder = copy_checkpoint(victims["tied"], tmp_path / "ck")
    target = folder / ".metadata" if linked == ".metadata" else next(folder.glob("*.distcp"))
    target.unlink()
    os.link(secret, target)
    for reader in READERS:
        error = attempt(reader, folder, tmp_path / f"out-{reader}")
        assert error is not None and "SECRET" not in str(error) and "ssh-rsa" not in str(error), (reader, error)
