"""CPU dry run of launch/bench/bench_scaling.py (issue #9): the tiny Llama on 2 gloo ranks through the three cases,
and the resume check's resharding at small size: save on 4 ranks, resume on 2, every fp32 master weight
equal (exact checksums) and the same loss on a fixed batch."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
from launch.bench import bench_scaling

TINY = ["--model", "tiny", "--cpu", "--batch", "1", "--seq", "32"]


def _job(rank, world_size, argv):
    result = bench_scaling.run(bench_scaling.parse_args(argv))
    for row in result["rows"]:
        row.pop("memory_report", None)
    return result


def test_cases_on_two_ranks(tmp_path, capsys):
    out = tmp_path / "cases.json"
    results = run_ranks(_job, 2, TINY + ["--warmup", "1", "--steps", "2", "--out", str(out)], timeout=60)
    rows = {r["case"]: r for r in results[0]["rows"]}
    assert list(rows) == list(bench_scaling.CASES)
    for row in rows.values():
        assert "error" not in row, row
        assert row["world"] == 2 and math.isfinite(row["last_loss"]) and row["step_ms_median"] > 0
    assert rows["adamw_fp32_master"]["persistent_bytes_per_param"] == pytest.approx(16.0)
    # bf16 + rho + bf16 grad + two 8-bit moments with group scales; the 1-d norm weights keep fp32 moments
    assert 7.0 < rows["flash_24bit"]["persistent_bytes_per_param"] < 7.3
    assert rows["flash_24bit_release"]["persistent_bytes_per_param"] == pytest.approx(
        rows["flash_24bit"]["persistent_bytes_per_param"] - 2.0)
    assert rows["flash_24bit_release"]["release_calls_per_step"] >= 1
    saved = __import__("json").loads(out.read_text())
    assert saved["meta"]["world"] == 2 and [r["case"] for r in saved["rows"]] == list(bench_scaling.CASES)


def test_tensor_parallel_cases_on_two_ranks(capsys):
    """--tp 2: the tiny Llama under TP on 2 ranks (rowwise o/down of 64 and 128 columns: whole groups)."""
    argv = TINY + ["--warmup", "1", "--steps", "1", "--tp", "2", "--cases", "adamw_fp32_master", "flash_24bit"]
    rows = {r["case"]: r for r in run_ranks(_job, 2, argv, timeout=60)[0]["rows"]}
    for row in rows.values():
        assert "error" not in row, row
        assert math.isfinite(row["last_loss"]) and row["step_ms_median"] > 0
    assert rows["adamw_fp32_master"]["persistent_bytes_per_param"] == pytest.approx(16.0)
    assert 7.0 < rows["flash_24bit"]["persistent_bytes_per_param"] < 7.3
    # each rank holds about half of the parameters (the norms are replicated)
    assert rows["flash_24bit"]["params_rank0"] < 0.6 * rows["flash_24bit"]["params_total"]


def test_save_on_four_ranks_resume_on_two(tmp_path):
    ck = tmp_path / "ck"
    save = run_ranks(_job, 4, TINY + ["--resume-check", str(ck), "--phase", "save"], timeout=60)[0]["resume_check"]
    assert (ck / "ckpt" / ".metadata").exists() and (ck / "saved.json").exists()
    assert save["world"] == 4 and len(save["losses"]) == 2
    resume = run_ranks(_job, 2, TINY + ["--resume-check", str(ck), "--phase", "resume"], timeout=60)
    check = resume[0]["resume_check"]
    assert check["saved_world"] == 4 and check["world"] == 2
    assert check["master_tensors"] == len(save["checksums"]) and check["master_tensors_differing"] == []
    assert check["eval_loss"] == pytest.approx(save["eval_loss"], abs=1e-5)
    assert len(check["losses"]) == 2 and all(math.isfinite(v) for v in check["losses"])


def _checksum_job(rank, world_size, tamper):
    cfg = bench_scaling.LlamaConfig.named("tiny")
    model, opt, _ = bench_scaling.build("flash_24bit", cfg, torch.device("cpu"), True)
    if tamper:  # swap two elements of one row: the plain sum stays, the positional checksum must not
        p = dict(model.named_parameters())["embed.weight"]
        local = bench_scaling.D.local(p)
        if rank == 0:
            with torch.no_grad():
                local[0, 0], local[0, 1] = local[0, 1].clone(), local[0, 0].clone()
    return bench_scaling.master_checksums(model, opt)


def test_master_checksums_do_not_depend_on_the_world_size():
    one, three = run_ranks(_checksum_job, 1, False)[0], run_ranks(_checksum_job, 3, False)[0]
    assert one == three
    tampered = run_ranks(_checksum_job, 2, True)[0]
    assert [k for k in one if one[k] != tampered[k]] == ["embed.weight"]


def test_resume_check_needs_a_phase():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "bench_scaling.py"), "--resume-check", "x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--phase" in proc.stderr
