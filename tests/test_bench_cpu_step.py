"""launch/bench/bench_cpu_step.py on tiny rows: both timing modes run and write the rows they promise."""

from __future__ import annotations

import json
import sys

import pytest

from flashdist.kernels import cpu
from launch.bench import bench_cpu_step



@pytest.fixture(autouse=True)
def _fused_step():
    if not cpu.available():  # built here, not at collection
        pytest.skip("the fused CPU step could not be built here (no compiler or ninja): the bench times it")

FUSED = ["flashdist FlashAdamW 24-bit, fused CPU step", "flashdist FlashAdamW fp32 params, fused CPU step",
         "flashdist FlashSGD m=0.9 24-bit, fused CPU step", "flashdist FlashLion 24-bit, fused CPU step"]


def _run(monkeypatch, tmp_path, *args):
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_cpu_step.py", "--threads", "1", "--scale", "0.002", *args,
                                      "--out", str(out)])
    bench_cpu_step.main()
    return json.loads(out.read_text())


def test_interleaved_rows_with_baseline(monkeypatch, tmp_path):
    data = _run(monkeypatch, tmp_path, "--interleave", "1", "--baseline", str(cpu.SOURCE))
    rows = {r["case"]: r for r in data["rows"]}
    assert list(rows) == ["torch AdamW fused, fp32 params"] + [n for f in FUSED for n in (f, f + " [baseline]")]
    for row in rows.values():
        assert row["steps"] == 2 and row["best_ms"] > 0 and row["best_ms"] <= row["step_ms"]
        assert row["vs_torch"] > 0
    assert rows["torch AdamW fused, fp32 params"]["vs_torch"] == 1.0
    assert data["machine"]["fused_step_isa"] == cpu.vector_isa()


def test_sequential_rows(monkeypatch, tmp_path):
    data = _run(monkeypatch, tmp_path, "--steps", "1", "--reference-rows", "2")
    cases = [r["case"] for r in data["rows"]]
    assert cases[0] == "torch AdamW fused, fp32 params" and set(FUSED) <= set(cases)
    assert "flashdist FlashAdamW 24-bit, eager reference" in cases
    assert all("error" not in r and r["mparams_per_cpu_s"] > 0 for r in data["rows"])
