"""launch/bench/bench_fsdp.py's rounds: the order of the cases, and each case compared with AdamW of its own round."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from launch.bench import bench_fsdp


def _row(case, rnd, ms):
    return {"case": case, "round": rnd, "step_ms_median": ms}


def test_paired_summary_compares_each_case_with_adamw_of_its_round():
    rows = [_row("adamw_fp32_master", 0, 100.0), _row("flash_24bit", 0, 90.0),
            _row("flash_24bit", 1, 132.0), _row("adamw_fp32_master", 1, 120.0),
            {"case": "flashoptim_24bit", "round": 0, "error": "ImportError"}]
    lines = {line.split(" | ")[0].strip("| "): line for line in bench_fsdp.paired_summary(rows).splitlines()}
    # ratios 0.9 and 1.1: geometric mean sqrt(0.99), not the ratio of the means (111 / 110)
    assert f"| {math.sqrt(0.99):.3f}x | 0.900-1.100 |" in lines["flash_24bit"]
    assert "| 90.0 / 132.0 | 111.0 |" in lines["flash_24bit"]
    assert "| 1.000x | 1.000-1.000 |" in lines["adamw_fp32_master"]
    assert "flashoptim_24bit" not in lines  # a case that failed in every round has no row


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_fsdp.main(["--rounds", "0"])
    assert exc.value.code == 2 and "--rounds must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_rounds_rotate_the_cases(tmp_path):
    out = tmp_path / "fsdp.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "bench" / "bench_fsdp.py"), "--model", "tiny", "--cpu", "--seq", "64", "--warmup", "1",
           "--steps", "1", "--rounds", "2", "--cases", "adamw_fp32_master", "flash_24bit", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["round"], r["case"]) for r in rows] == [(0, "adamw_fp32_master"), (0, "flash_24bit"),
                                                       (1, "flash_24bit"), (1, "adamw_fp32_master")]
    assert all("error" not in r for r in rows)
    assert all(len(r["peak_gib_per_rank"]) == 2 for r in rows)  # every rank's peak (NaN on the CPU)
    assert "vs AdamW, geometric mean" in proc.stdout
