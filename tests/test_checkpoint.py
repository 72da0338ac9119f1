"""flashdist.checkpoint in one process: atomic DCP save/load, fp32 export/import, refusal of bad input."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import flashdist
from flashdist import FlashAdamW, checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed=0, width=40):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 70),
                               torch.nn.LayerNorm(70), torch.nn.Linear(70, 4)).to(torch.bfloat16)


X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _train(model, opt, n):
    for _ in range(n):
        opt.zero_grad()
        model(X).float().square().mean().backward()
        opt.step()


def _snapshot(model, opt):
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"s.{i}.{k}"] = v.clone()
    return out


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fmt", ["portable", "compressed"])
def test_save_load_resume_exact(tmp_path, fmt):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format=fmt)
    _train(model, opt, 3)
    checkpoint.save(tmp_path / "ck", model, opt, extra={"step": 3, "note": "hello", "rng": torch.arange(4)})
    _only_checkpoint_left(tmp_path)
    model2 = _model(seed=5)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2, state_dict_format=fmt)
    extra = checkpoint.load(tmp_path / "ck", model2, opt2)
    assert extra["step"] == 3 and extra["note"] == "hello" and torch.equal(extra["rng"], torch.arange(4))
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))
    _train(model, opt, 2)
    _train(model2, opt2, 2)
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))


@pytest.mark.parametrize("saved, loading", [("portable", "compressed"), ("compressed", "portable")])
def test_load_takes_either_format(tmp_path, saved, loading):
    """The optimizer's state_dict_format says how it SAVES; a checkpoint in the other format loads too, and
    re-quantizing unchanged portable moments gives the same codes: the resumed run is exact either way."""
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format=saved)
    _train(model, opt, 3)
    checkpoint.save(tmp_path / "ck", model, opt)
    model2 = _model(seed=5)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2, state_dict_format=loading)
    checkpoint.load(tmp_path / "ck", model2, opt2)
    assert opt2.state_dict_format == loading
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))
    _train(model, opt, 2)
    _train(model2, opt2, 2)
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))


def test_never_stepped_and_no_grad_params(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters())
    checkpoint.save(tmp_path / "ck", model, opt)
    model2 = _model(seed=3)
    opt2 = FlashAdamW(model2.parameters())
    checkpoint.load(tmp_path / "ck", model2, opt2)
    # the loaded never-stepped state is the state a first step makes: none is held until then
    assert len(opt2.state) == 0
    for m, o in ((model, opt), (model2, opt2)):
        for i, p in enumerate(m.parameters()):
            p.grad = torch.full_like(p, 0.01 * (i + 1))
        o.step()
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))


def test_extra_cannot_hold_the_key_of_flashdists_record_of_ties(tmp_path):
    """checkpoint.save records the model's tied weights in extra under "flashdist_tied" (an export reads it, load
    does not return it): a user's entry of that name is refused in one line before anything is written, where
    it was replaced on save and dropped on load."""
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="extra holds the key 'flashdist_tied'"):
        checkpoint.save(tmp_path / "ck", model, opt, extra={"flashdist_tied": "mine"})
    assert not (tmp_path / "ck").exists()
    checkpoint.save(tmp_path / "ck", model, opt, extra={"step": 3})
    assert checkpoint.load(tmp_path / "ck", model, opt) == {"step": 3}


def test_second_save_replaces_first(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 1})
    _train(model, opt, 1)
    checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 2})
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    fresh = _model()
    assert checkpoint.load(tmp_path / "ck", fresh, FlashAdamW(fresh.parameters()))["n"] == 2


def test_fp32_export_and_import(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is part of the [test] extra")
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    sd = flashdist.export_fp32_state_dict(model, opt)
    assert set(sd) == set(model.state_dict())
    w = model[0].weight
    assert sd["0.weight"].dtype == torch.float32 and torch.equal(sd["0.weight"], opt.master_weight(w))
    assert not torch.equal(sd["0.weight"], w.float())  # rho carries information beyond bf16
    safetensors.save_file(sd, tmp_path / "w.safetensors")
    fp32_model = _model(seed=9).float()
    fp32_model.load_state_dict(safetensors.load_file(tmp_path / "w.safetensors"))
    assert torch.equal(fp32_model[0].weight, sd["0.weight"])
    # and back: a fresh bf16 model + optimizer starts from the same 24-bit master weights
    model2 = _model(seed=4)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2)
    flashdist.load_fp32_state_dict(model2, opt2, sd)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.master_weight(p), opt2.master_weight(q))


def test_fp32_import_rejects_mismatch_and_changes_nothing():
    model = _model()
    opt = FlashAdamW(model.parameters())
    before = _snapshot(model, opt)
    sd = {k: v.float() for k, v in _model(seed=2).state_dict().items()}
    bad = dict(sd)
    bad.pop("0.bias")
    with pytest.raises(ValueError, match="missing.*0.bias"):
        flashdist.load_fp32_state_dict(model, opt, bad)
    bad = dict(sd, **{"2.weight": torch.zeros(70, 41)})
    with pytest.raises(ValueError, match="'2.weight'.*shape"):
        flashdist.load_fp32_state_dict(model, opt, bad)
    _equal(before, _snapshot(model, opt))


def _saved(tmp_path, **kw):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    checkpoint.save(tmp_path / "ck", model, opt, **kw)
    return tmp_path / "ck"


def _expect_refusal(path, match, *, width=40):
    model = _model(seed=7, width=width)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    before = _snapshot(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(path, model, opt)
    _equal(before, _snapshot(model, opt))


def test_other_model_is_refused(tmp_path):
    path = _saved(tmp_path)
    _expect_refusal(path, r"other shapes.*model\.0\.weight", width=48)

    class Bigger(torch.nn.Sequential):
        pass

    model = Bigger(*_model(), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    opt = FlashAdamW(model.parameters())
    with pytest.raises(checkpoint.CheckpointError, match=r"missing from the checkpoint.*model\.5\.weight"):
        checkpoint.load(path, model, opt)
    smaller = torch.nn.Sequential(*list(_model())[:3]).to(torch.bfloat16)
    with pytest.raises(checkpoint.CheckpointError, match=r"not in this model.*model\.3\.weight"):
        checkpoint.load(path, smaller, FlashAdamW(smaller.parameters()))


def test_missing_and_truncated_files_are_refused(tmp_path):
    path = _saved(tmp_path)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _expect_refusal(path, "could not read checkpoint")
    shard.unlink()
    _expect_refusal(path, "could not read checkpoint")
    (path / ".metadata").write_bytes(b"\x80\x04truncated")
    _expect_refusal(path, "not a valid DCP metadata")
    _expect_refusal(tmp_path / "nowhere", "no checkpoint")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_malicious_pickles_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _saved(tmp_path, extra={"x": 1})
    # 1) a metadata file that would run a command when unpickled
    meta = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    _expect_refusal(path, "refusing to load posix.system|refusing to load os.system|not a valid DCP metadata")
    assert not (tmp_path / "pwned").exists()
    (path / ".metadata").write_bytes(meta)
    # 2) a non-tensor entry whose bytes would run a command (DCP itself reads these with weights_only=False)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    blob = shard.read_bytes()
    import io

    good = io.BytesIO()
    torch.save(1, good)
    evil = io.BytesIO()
    torch.save(_Exploit(), evil)
    assert good.getvalue() in blob
    if len(evil.getvalue()) == len(good.getvalue()):  # same length: swap in place
        shard.write_bytes(blob.replace(good.getvalue(), evil.getvalue()))
    else:
        pytest.skip("cannot splice a same-length malicious entry into this DCP file layout")
    model = _model()
    opt = FlashAdamW(model.parameters())
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(path, model, opt)
    assert not (tmp_path / "pwned").exists()


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch
    import torch.distributed.checkpoint as dcp
    import flashdist
    from flashdist import checkpoint
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    opt = flashdist.FlashAdamW(model.parameters())
    path = sys.argv[1]
    if sys.argv[2] == "first":
        checkpoint.save(path, model, opt, extra={"n": 1})
        sys.exit(0)
    # second save: SIGKILL ourselves in the middle of writing the shard files
    real = dcp.FileSystemWriter.write_data
    def dying(self, plan, planner):
        fut = real(self, plan, planner)
        os.kill(os.getpid(), signal.SIGKILL)
    dcp.FileSystemWriter.write_data = dying
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpoint.save(path, model, opt, extra={"n": 2})
""")


@pytest.mark.parametrize("moment", ["writing", "between-renames"])
def test_killed_during_save_leaves_previous_checkpoint(tmp_path, moment):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    path = tmp_path / "ck"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, str(script), str(path), "first"], check=True, env=env)
    if moment == "writing":
        proc = subprocess.run([sys.executable, str(script), str(path), "second"], env=env)
        assert proc.returncode == -signal.SIGKILL
        assert (path / ".metadata").exists()
    else:  # the instant after PATH was moved to PATH.old and before PATH.tmp took its place
        os.replace(path, path.with_name("ck.old"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    expected = [p.detach().clone() for p in model.parameters()]
    loaded = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    opt = FlashAdamW(loaded.parameters())
    assert checkpoint.load(path, loaded, opt)["n"] == 1
    for p, e in zip(loaded.parameters(), expected):
        assert torch.equal(p, e)
    # what the killed save left (its temporary folder, or PATH.old) neither blocks nor survives the next save
    assert len(os.listdir(tmp_path)) == (3 if moment == "writing" else 2)
    checkpoint.save(path, loaded, opt, extra={"n": 3})
    assert sorted(os.listdir(tmp_path)) == ["ck", "kill.py"]
    assert checkpoint.load(path, loaded, opt)["n"] == 3


def test_compressed_checkpoint_into_fp32_moments_is_refused_with_the_reason(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format="compressed")
    _train(model, opt, 2)
    checkpoint.save(tmp_path / "ck", model, opt)
    model2 = _model(seed=5)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2, quantize_states=False)
    before = _snapshot(model2, opt2)
    with pytest.raises(checkpoint.CheckpointError, match="compressed .*quantize_states=False"):
        checkpoint.load(tmp_path / "ck", model2, opt2)
    _equal(before, _snapshot(model2, opt2))


@pytest.mark.parametrize("how", ["32-bit masters", "crafted codes"])
def test_optimizer_state_of_another_dtype_is_refused_not_cast(tmp_path, how):
    """DCP reads into the live tensors, casting what it reads: an int16 rho (a 32-bit-master checkpoint, or one
    crafted) or int32 codes would wrap into the int8 the optimizer keeps (300 -> 44) without a word. Refused
    in one line naming the entries, the model and optimizer unchanged; the same file loads into the optimizer
    it was saved from."""
    from tests._cli import run_cli

    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2, state_dict_format="compressed",
                     master_weight_bits=32 if how == "32-bit masters" else 24)
    _train(model, opt, 2)
    checkpoint.save(tmp_path / "ck", model, opt)
    path = tmp_path / "ck"
    if how == "crafted codes":
        assert run_cli("convert", path, tmp_path / "ck.pt", "--to", "torch")[0] == 0
        state = torch.load(tmp_path / "ck.pt", weights_only=True)
        entry = state["optim"]["state"]["0.weight"]
        entry["exp_avg_codes"] = torch.full(entry["exp_avg_codes"].shape, 1000, dtype=torch.int32)
        torch.save(state, tmp_path / "bad.pt")
        path = tmp_path / "bad"
        assert run_cli("convert", tmp_path / "bad.pt", path, "--to", "dcp")[0] == 0
    model2 = _model(seed=5)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2)
    _train(model2, opt2, 1)
    before = _snapshot(model2, opt2)
    with pytest.raises(checkpoint.CheckpointError, match="of another dtype") as refused:
        checkpoint.load(path, model2, opt2)
    entry = "rho (int16 vs int8)" if how == "32-bit masters" else "exp_avg_codes (int32 vs int8)"
    assert "\n" not in str(refused.value) and f"optim.state.0.weight.{entry}" in str(refused.value)
    assert ("master_weight_bits=32, as its rho says" in str(refused.value)) == (how == "32-bit masters")
    _equal(before, _snapshot(model2, opt2))
    if how == "32-bit masters":
        model3 = _model(seed=5)
        opt3 = FlashAdamW(model3.parameters(), lr=1e-2, master_weight_bits=32)
        checkpoint.load(path, model3, opt3)
        _equal(_snapshot(model, opt), _snapshot(model3, opt3))


# ----- saves that never lose, mix or half-write what was saved --------------------------------------------


def _only_checkpoint_left(folder, name="ck"):
    assert sorted(os.listdir(folder)) == [name], "a temporary folder or lock file was left behind"


def test_save_refuses_a_file_or_foreign_folder_at_the_path(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters())
    user_file = tmp_path / "ck"
    user_file.write_text("my notes")
    with pytest.raises(checkpoint.CheckpointError, match=r"ck exists and is not a folder.*move the file"):
        checkpoint.save(user_file, model, opt)
    assert user_file.read_text() == "my notes"
    _only_checkpoint_left(tmp_path)
    user_file.unlink()
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(checkpoint.CheckpointError, match=r"not part of a checkpoint \(__0_0\.distcp, config\.json\)"):
        checkpoint.save(folder, model, opt)
    assert sorted(os.listdir(folder)) == ["__0_0.distcp", "config.json"]
    _only_checkpoint_left(tmp_path)
    (tmp_path / "link").symlink_to(folder)
    with pytest.raises(checkpoint.CheckpointError, match="symbolic link"):
        checkpoint.save(tmp_path / "link", model, opt)
    assert (tmp_path / "link").is_symlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    checkpoint.save(empty, model, opt, extra={"n": 1})  # an empty folder holds nothing to lose
    assert checkpoint.load(empty, model, opt)["n"] == 1


def _pause_after_writing(pause: threading.Event, resume: threading.Event, who: str):
    """Patch DCP's writer so the save in thread ``who`` stops after writing its shards until ``resume``."""
    real = torch.distributed.checkpoint.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        fut = real(self, plan, planner)
        if threading.current_thread().name == who:
            pause.set()
            assert resume.wait(60)
        return fut

    return write_data


def _loads_as(path, model, tag):
    loaded = _model(seed=11)
    extra = checkpoint.load(path, loaded, FlashAdamW(loaded.parameters()))
    assert extra["who"] == tag
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p, q), f"{tag}'s extra with other weights: the checkpoint mixes two saves"


def test_concurrent_saves_never_mix(tmp_path, monkeypatch):
    """Save A writes its shards and stalls; save B to the same path runs start to end; then A finishes. The
    checkpoint is B's whole after B, and A's whole after A (with one shared temporary folder, A's metadata
    ended up over B's shards)."""
    path = tmp_path / "ck"
    model_a, model_b = _model(seed=1), _model(seed=2)
    opt_a, opt_b = FlashAdamW(model_a.parameters()), FlashAdamW(model_b.parameters())
    paused, resume = threading.Event(), threading.Event()
    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data",
                        _pause_after_writing(paused, resume, "A"))
    errors = []

    def save_a():
        try:
            checkpoint.save(path, model_a, opt_a, extra={"who": "A"})
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    a = threading.Thread(target=save_a, name="A")
    a.start()
    assert paused.wait(60)
    checkpoint.save(path, model_b, opt_b, extra={"who": "B"})
    _loads_as(path, model_b, "B")
    resume.set()
    a.join(60)
    assert not errors, errors
    _loads_as(path, model_a, "A")
    _only_checkpoint_left(tmp_path)


def test_renames_wait_for_the_lock(tmp_path):
    """The renames that put a checkpoint in place happen under an exclusive flock on PATH.flashdist-lock."""
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX")
    model = _model()
    opt = FlashAdamW(model.parameters())
    path = tmp_path / "ck"
    fd = os.open(tmp_path / "ck.flashdist-lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    saver = threading.Thread(target=checkpoint.save, args=(path, model, opt))
    saver.start()
    saver.join(8)
    blocked = saver.is_alive() and not path.exists()
    os.close(fd)
    saver.join(60)
    assert blocked and (path / ".metadata").exists()
    _only_checkpoint_left(tmp_path)


def test_leftovers_of_dead_saves_are_removed_never_loaded(tmp_path):
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX")
    model = _model()
    opt = FlashAdamW(model.parameters())
    checkpoint.save(tmp_path / "good", model, opt, extra={"n": 1})
    dead, live, foreign = (tmp_path / f"ck.tmp-{c * 32}" for c in "abc")
    shutil.copytree(tmp_path / "good", dead)  # a whole checkpoint that was never moved into place
    for folder in (dead, live, foreign):
        folder.mkdir(exist_ok=True)
        (folder / ".flashdist-writing").touch()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "ck", model, opt)
    fd = os.open(live / ".flashdist-writing", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save still writing
    try:
        checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 2})
    finally:
        os.close(fd)
    assert not dead.exists() and live.exists() and (foreign / "notes.txt").read_text() == "mine"
    assert checkpoint.load(tmp_path / "ck", model, opt)["n"] == 2


def _two_saves(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    checkpoint.save(tmp_path / "a", model, opt, extra={"step": 1})
    _train(model, opt, 1)
    checkpoint.save(tmp_path / "b", model, opt, extra={"step": 2})
    return tmp_path / "a", tmp_path / "b"


def test_shard_of_another_save_is_refused(tmp_path):
    a, b = _two_saves(tmp_path)
    shard = next(a.glob("*.distcp"))
    original = shard.read_bytes()
    assert len(original) == len((b / shard.name).read_bytes())  # same model: the files differ in content only
    shutil.copy(b / shard.name, shard)
    _expect_refusal(a, rf"shard .*{shard.name} belongs to another save .* mixes files of two saves")
    shutil.copy(b / ".metadata", a / ".metadata")  # the other save's metadata over this save's shard
    shard.write_bytes(original)
    _expect_refusal(a, rf"shard .*{shard.name} belongs to another save")


def test_damaged_shard_is_refused(tmp_path):
    a, _ = _two_saves(tmp_path)
    shard = next(a.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit inside a tensor
    shard.write_bytes(bytes(data))
    _expect_refusal(a, rf"shard .*{shard.name} is damaged \(CRC-32")


def test_verify_shard_reads_the_whole_file_only_when_asked(tmp_path):
    """crc=False checks the shard's id and length only (the rank that does not own the file's CRC check):
    a flipped bit inside passes it, and fails the full check."""
    from flashdist.checkpoint.dcp import read_metadata, verify_shard

    a, _ = _two_saves(tmp_path)
    shard = next(a.glob("*.distcp"))
    save_id = read_metadata(a).storage_meta.save_id
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    verify_shard(shard, save_id, crc=False)
    with pytest.raises(checkpoint.CheckpointError, match="is damaged"):
        verify_shard(shard, save_id, crc=True)


def test_checkpoints_without_save_ids_still_load_and_plain_dcp_reads_ours(tmp_path):
    """A checkpoint written by plain dcp.save (as flashdist did before shards carried ids) loads; and
    torch's own DCP reader reads a flashdist checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
             "extra": {"step": 2}}
    dcp.save(state, checkpoint_id=str(tmp_path / "legacy"))
    model2 = _model(seed=5)
    opt2 = FlashAdamW(model2.parameters(), lr=1e-2)
    assert checkpoint.load(tmp_path / "legacy", model2, opt2)["step"] == 2
    _equal(_snapshot(model, opt), _snapshot(model2, opt2))
    checkpoint.save(tmp_path / "ck", model, opt)
    back = {"model": {k: torch.zeros_like(v) for k, v in get_model_state_dict(model).items()}}
    dcp.load(back, checkpoint_id=str(tmp_path / "ck"))
    _equal(back["model"], get_model_state_dict(model))
    # a shard of a newer save inside an older-format checkpoint is a mix too
    shard = next((tmp_path / "legacy").glob("*.distcp"))
    shutil.copy(tmp_path / "ck" / shard.name, shard)
    _expect_refusal(tmp_path / "legacy", "predates shard ids: the folder mixes files of two saves")


def _read_only_folder(tmp_path) -> Path:
    """A folder no file can be created in: chmod 555 for a normal user; /sys for root (which chmod cannot stop)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    candidates = [folder, Path("/sys")]
    for candidate in candidates:
        try:
            (candidate / "flashdist-probe").mkdir()
        except OSError:
            return candidate
        (candidate / "flashdist-probe").rmdir()
    pytest.skip("no read-only folder here: running as root and /sys is writable")


def test_read_only_folder_gives_one_clear_error(tmp_path):
    model = _model()
    opt = FlashAdamW(model.parameters())
    folder = _read_only_folder(tmp_path)
    try:
        checkpoint.save(folder / "ck", model, opt)
    except Exception as e:  # noqa: BLE001 - DCP's own failure is a BaseException that this would miss
        error = e
    assert isinstance(error, checkpoint.CheckpointWriteError) and isinstance(error, OSError)
    message = str(error)
    assert len(message.splitlines()) == 1 and f"{folder / 'ck'}" in message and "nothing was written" in message
    assert not any(p.name.startswith("ck") for p in folder.iterdir())


def test_an_optimizer_without_torchs_state_dict_form_is_named_and_nothing_is_written(tmp_path):
    """An optimizer whose state_dict() is not torch's {'state', 'param_groups'} (a wrapper of two optimizers)
    is refused in one line that says what save takes; the folder is left as it was."""
    model = _model()

    class TwoOptimizers(torch.optim.SGD):
        def state_dict(self):
            return {"first": super().state_dict()}

    checkpoint.save(tmp_path / "ck", model, FlashAdamW(model.parameters()), extra={"n": 1})
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(tmp_path / "ck", model, TwoOptimizers(model.parameters(), lr=0.1))
    message = str(info.value)
    assert len(message.splitlines()) == 1 and f"{tmp_path / 'ck'} was not changed" in message
    assert "reading the model's and optimizer's state failed" in message and "'param_groups'" in message
    _only_checkpoint_left(tmp_path)
    fresh = _model()
    assert checkpoint.load(tmp_path / "ck", fresh, FlashAdamW(fresh.parameters()))["n"] == 1


def test_failed_write_keeps_the_previous_checkpoint_and_removes_its_own_folder(tmp_path, monkeypatch):
    model = _model()
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 1})
    real = torch.distributed.checkpoint.FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        real(self, plan, planner)  # the shards are on disk, the metadata is not
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", disk_full)
    _train(model, opt, 1)
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 2})
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "No space left on device" in message
    assert f"{tmp_path / 'ck'} was not changed" in message
    _only_checkpoint_left(tmp_path)
    monkeypatch.undo()
    fresh = _model()
    assert checkpoint.load(tmp_path / "ck", fresh, FlashAdamW(fresh.parameters()))["n"] == 1


def test_file_system_without_locks_warns_and_still_saves(tmp_path, monkeypatch):
    """Where flock is not available (some network file systems), a save warns once and still completes."""
    fcntl = pytest.importorskip("fcntl", reason="file locks are POSIX")

    def no_locks(fd, flags):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(checkpoint.publish, "_warned_no_flock", False)
    model = _model()
    opt = FlashAdamW(model.parameters())
    with pytest.warns(UserWarning, match="cannot lock files.*not serialised"):
        checkpoint.save(tmp_path / "ck", model, opt, extra={"n": 1})
    assert checkpoint.load(tmp_path / "ck", model, opt)["n"] == 1
    _only_checkpoint_left(tmp_path)


@pytest.mark.parametrize("biases", [False, True], ids=["matrices-only", "with-adamw-groups"])
def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(tmp_path, biases):
    """A FlashAdamW checkpoint loaded into a FlashMuon: refused, naming what each side holds by its optimizer
    (FlashMuon was named as FlashSGD, or as "another optimizer")."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=biases), torch.nn.Linear(32, 8, bias=biases)).bfloat16()

    model = net()
    opt = FlashAdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1)
    checkpoint.save(tmp_path / "ck", model, opt)
    other = net()
    want = "FlashMuon" if biases else "FlashSGD/FlashSGDW with momentum, or FlashMuon on matrices only"
    with pytest.raises(checkpoint.CheckpointError, match=rf"\(FlashAdamW/FlashAdam\), this optimizer's .*\({want}\)"):
        checkpoint.load(tmp_path / "ck", other, flashdist.FlashMuon(flashdist.muon_param_groups(other), lr=0.02))
