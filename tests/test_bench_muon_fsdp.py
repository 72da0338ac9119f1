"""launch/bench/bench_muon_fsdp.py on 2 gloo ranks with tiny Llama shapes: FlashMuon's check against one process
passes, every Muon matrix has exactly one owner (round-robin), and the bytes each rank communicates are the
exchange's padded budget; the whole-matrix baseline computes every matrix on every rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashdist import muon_param_groups
from launch.llama import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # multi-process


def test_cpu_smoke_run_divides_the_matrices_and_counts_the_bytes(tmp_path):
    out, world = tmp_path / "muon.json", 2
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "launch" / "bench" / "bench_muon_fsdp.py"), "--model", "tiny", "--cpu", "--seq", "16",
           "--warmup", "0", "--steps", "1", "--check", "--check-steps", "2", "--cases", "flash_muon", "muon_gathered",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["check"]["tensors_differing"] == 0 and result["check"]["tensors_compared"] > 100
    rows = {r["case"]: r for r in result["rows"]}
    assert all("error" not in r for r in rows.values()), rows

    matrices = [p for _, p in muon_param_groups(Llama(LlamaConfig.named("tiny")))[0]["params"]]
    flash, gathered = rows["flash_muon"], rows["muon_gathered"]
    assert flash["muon_matrices"] == gathered["muon_matrices"] == len(matrices)
    owned = [r["owned_matrices"] for r in flash["ranks"]]
    assert sum(owned) == len(matrices) and max(owned) - min(owned) <= 1, owned  # each matrix once, round-robin
    assert all(r["owned_matrices"] == len(matrices) for r in gathered["ranks"])  # every rank computes every one
    # FSDP2 rows split in two: each part off its owner goes there and back once, bf16, padded to an even length
    pads = [math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for p in matrices]
    wire = sum(2 * (world - 1) * (pad + pad % 2) * 2 for pad in pads)
    numel = sum(p.numel() for p in matrices)
    assert flash["bytes_per_muon_param_all_ranks"] == wire / numel == 4 * (world - 1) / world
    assert all(r["sent_bytes_per_local_param"] == r["received_bytes_per_local_param"] == 2.0 for r in flash["ranks"])
    assert all(r["received_bytes_per_local_param"] == 2 * (world - 1) for r in gathered["ranks"])
    # bf16 parameters + rho + 8-bit momentum against fp32 parameters, gradients and momentum
    held = [r["ranks"][0]["persistent_bytes_per_param"] for r in (flash, gathered)]
    assert held[0] < 7.2 < 12 < held[1], held
    assert "| flash_muon |" in proc.stdout and "CPU gloo: a smoke run, not performance" in proc.stdout
