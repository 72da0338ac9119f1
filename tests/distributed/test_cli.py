"""The ``flashdist`` command: conversions that round-trip bit for bit, export, and refusals of bad input."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from test_checkpoint_reshard import STEPS_AFTER, STEPS_BEFORE, _assert_same, _build, _gather, _resume_job, _save_job

import flashdist
from flashdist import checkpoint
from flashdist.checkpoint import FORMAT_VERSION
from flashdist.cli import main


def _cli(*args) -> tuple[int, str, str]:
    """Run the command in this process (an import of torch per call would cost seconds)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse: usage errors and --help
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_console_command_runs():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "flashdist.cli", "inspect", "/nonexistent"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("flashdist inspect: no such file")


@pytest.mark.parametrize("fmt", ["compressed", "portable"])
def test_dcp_to_torch_to_dcp_then_resume_on_2_ranks(tmp_path, fmt):
    src = tmp_path / "ck3"
    run_ranks(_save_job, 3, str(src), "compressed")
    direct = run_ranks(_resume_job, 2, str(src), "compressed")[0]
    assert main(["convert", str(src), str(tmp_path / "one.pt"), "--to", "torch", "--format", fmt]) == 0
    assert main(["convert", str(tmp_path / "one.pt"), str(tmp_path / "back"), "--to", "dcp",
                 "--format", "compressed"]) == 0
    via_file = run_ranks(_resume_job, 2, str(tmp_path / "back"), "compressed")[0]
    _assert_same(direct[0], via_file[0], f"loaded after DCP -> torch ({fmt}) -> DCP")
    _assert_same(direct[1], via_file[1], f"resumed after DCP -> torch ({fmt}) -> DCP")


def test_safetensors_round_trip_and_inspect(tmp_path, capsys):
    src = tmp_path / "ck"
    _save_job(0, 1, str(src), "compressed")
    assert main(["convert", str(src), str(tmp_path / "ck.safetensors"), "--to", "safetensors"]) == 0
    assert main(["convert", str(tmp_path / "ck.safetensors"), str(tmp_path / "back"), "--to", "dcp"]) == 0
    loaded, _ = _resume_job(0, 1, str(tmp_path / "back"), "compressed")
    reference, _ = _resume_job(0, 1, str(src), "compressed")
    _assert_same(reference, loaded, "DCP -> safetensors -> DCP")
    capsys.readouterr()
    assert main(["inspect", str(src), "--json"]) == 0
    import json

    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "dcp" and info["optimizer_format"] == "compressed" and info["format_version"] == FORMAT_VERSION
    assert info["master_weight_bits"] == [24] and info["step"] == STEPS_BEFORE
    model, _ = _build("compressed", False)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_export_matches_export_fp32_state_dict(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is part of the [test] extra")
    model, opt = _build("portable", False)
    from test_checkpoint_reshard import _train

    _train(model, opt, 0, STEPS_BEFORE)
    checkpoint.save(tmp_path / "ck", model, opt)
    rc, out, err = _cli("export", tmp_path / "ck", tmp_path / "w.safetensors")
    assert rc == 0, err
    exported = safetensors.load_file(tmp_path / "w.safetensors")
    expected = flashdist.export_fp32_state_dict(model, opt)
    assert exported.keys() == expected.keys()
    for k in expected:
        assert torch.equal(exported[k], expected[k]), k
    fresh = type(model)().float()
    fresh.load_state_dict(exported)


def test_bad_input_exits_non_zero_and_writes_nothing(tmp_path):
    src = tmp_path / "ck"
    _save_job(0, 1, str(src), "compressed")
    out = tmp_path / "out.pt"
    rc, _, err = _cli("inspect", tmp_path / "missing")
    assert rc == 1 and "no such file" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli("convert", src, out, "--to", "zip")
    assert rc == 2 and "invalid choice" in err
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 100)
    rc, _, err = _cli("convert", junk, out, "--to", "torch")
    assert rc == 1 and "not a DCP directory" in err
    torch.save({"model": {}}, tmp_path / "t.pt")
    data = (tmp_path / "t.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    rc, _, err = _cli("convert", tmp_path / "t.pt", out, "--to", "dcp")
    assert rc == 1 and "could not read" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in src.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    next(broken.glob("*.distcp")).unlink()
    rc, _, err = _cli("convert", broken, out, "--to", "torch")
    assert rc == 1 and "could not read checkpoint" in err
    assert not out.exists() and not Path(str(out) + ".tmp").exists()
    rc, _, err = _cli("convert", src, tmp_path / "x", "--to", "torch", "--from", "deepspeed")
    assert rc == 1 and "not a DeepSpeed checkpoint" in err
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "latest").write_text("global_step2")
    rc, _, err = _cli("convert", ds, tmp_path / "x", "--to", "dcp", "--from", "deepspeed")
    assert rc == 1 and "global_step2 does not exist" in err and len(err.strip().splitlines()) == 1
    (ds / "global_step2").mkdir()
    (ds / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"junk")
    rc, _, err = _cli("convert", ds, tmp_path / "x", "--to", "dcp")
    assert rc == 1 and "no model-states file" in err
    assert not (tmp_path / "x").exists()
    out.write_bytes(b"keep me")
    rc, _, err = _cli("convert", src, out, "--to", "torch")
    assert rc == 1 and "--force" in err and out.read_bytes() == b"keep me"


def test_help_has_examples():
    for command in ("inspect", "convert", "export"):
        rc, out, _ = _cli(command, "--help")
        assert rc == 0 and "example" in out
