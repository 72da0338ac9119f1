"""launch/data.py's corpus and launch/convergence.py's report, on the CPU with tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import convergence, data

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)


def test_corpus_is_split_by_file_hash_cached_and_described_by_its_manifest(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": f"x = {i}\n".encode() * (i + 1) for i in range(60)}
    files["pkg0/__pycache__/skip.py"] = b"cached"
    files["pkg1/site-packages/skip.py"] = b"nested site-packages"
    files["pkg2/notes.txt"] = b"not python"
    _tree(tmp_path / "lib", files)
    roots = [("lib", tmp_path / "lib")]
    where = data.build_corpus(tmp_path / "cache", roots)
    manifest = json.loads((where / "manifest.json").read_text())
    kept = sorted(k for k in files if k.endswith(".py") and "skip" not in k)
    val = [k for k in kept if data.is_validation(f"lib/{k}")]
    assert 0 < len(val) < len(kept)  # both sides hold files
    assert (manifest["train_files"], manifest["val_files"]) == (len(kept) - len(val), len(val))
    # files in sorted order, each followed by a NUL: the bytes are exactly the listed files
    expect_val = b"".join(files[k] + b"\0" for k in val)
    assert (where / "val.bin").read_bytes() == expect_val and manifest["val_bytes"] == len(expect_val)
    train, val_t, loaded = data.load_corpus(cache_dir=tmp_path / "cache", roots=roots)
    assert bytes(val_t.numpy()) == expect_val and train.numel() == manifest["train_bytes"]
    assert loaded["listing_sha256"] == manifest["listing_sha256"]
    # built once: the cached copy is reused, a changed listing gets a copy of its own
    stamp = (where / "train.bin").stat().st_mtime_ns
    assert data.build_corpus(tmp_path / "cache", roots) == where
    assert (where / "train.bin").stat().st_mtime_ns == stamp
    _tree(tmp_path / "lib", {"pkg0/new.py": b"y = 1\n"})
    assert data.build_corpus(tmp_path / "cache", roots) != where
    with pytest.raises(FileNotFoundError, match="no \\*.py files"):
        data.build_corpus(tmp_path / "cache", [("empty", tmp_path / "nothing")])


def test_capped_corpus_reads_only_the_first_files(tmp_path):
    _tree(tmp_path / "lib", {f"m{i:02d}.py": bytes([65 + i % 26]) * 1000 for i in range(40)})
    train, val, info = data.load_corpus(max_bytes=5000, roots=[("lib", tmp_path / "lib")])
    assert 5000 <= train.numel() < 7100 and info["train_files"] < 40
    assert not (tmp_path / "runs").exists()


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=str(ROOT))


@pytest.mark.slow
def test_time_limit_stops_a_run_that_is_then_reported_partial(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--d-model", "32", "--n-layer", "1", "--n-head", "2",
           "--seq-len", "32", "--batch-size", "4", "--corpus-mb", "1", "--eval-batches", "1", "--eval-every", "1000",
           "--steps", "100000", "--time-limit", "1", "--out-dir", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--time-limit 1 s reached" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] and 0 < summary["steps"] < 100000
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == summary["steps"] and "val_loss" in rows[-1]  # the last step is evaluated
    status = convergence.read_run({"variant": "v", "seed": 0, "dir": out, "steps": 100000})
    assert status["status"] == "partial" and status["tokens"] == summary["tokens"]


@pytest.mark.slow
def test_cpu_convergence_shows_rho_recovering_what_plain_bf16_loses(tmp_path):
    """The tiny CPU version end to end: a main phase, then fine-tuning AdamW's weights at lr 3e-5, where most
    Adam updates are below half a bf16 spacing: bf16 without rho gains less than AdamW from the same start."""
    out = tmp_path / "conv"
    cmd = [sys.executable, str(ROOT / "launch" / "convergence.py"), "--cpu", "--config", "tiny", "--out", str(out),
           "--variants", convergence.ADAMW, convergence.NO_RHO, "--seeds", "0", "--rho-seeds", "0",
           "--steps", "40", "--rho-steps", "20"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "convergence.json").read_text())
    assert set(report["phases"]) == {"main", "rho"}
    for phase in report["phases"].values():
        assert all(r["status"] == "complete" for r in phase["runs"])
    rho = {r["variant"]: r for r in report["phases"]["rho"]["runs"]}
    start = {r["val_curve"][0][1] for r in rho.values()}
    assert len(start) == 1  # both start from the same bf16-rounded weights, evaluated on the same windows
    gain = {v: r["val_curve"][0][1] - r["val_curve"][-1][1] for v, r in rho.items()}
    assert gain[convergence.ADAMW] > 1.5 * gain[convergence.NO_RHO]
    moved = {v: r["bf16_moved"][-1][1] for v, r in rho.items()}
    assert moved[convergence.NO_RHO] < moved[convergence.ADAMW]  # updates lost to rounding
    md = (out / "convergence.md").read_text()
    assert "Partial: none" in md and "| bf16 without rho |" in md
    assert (out / "convergence.png").stat().st_size > 1000 and (out / "rho.png").stat().st_size > 1000
    # again with the same arguments: finished runs are not run again
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "started" not in proc.stdout


def test_bad_flags_are_refused_with_one_line(tmp_path, capsys):
    from launch import train

    for argv, message in [(["--init-from", str(tmp_path / "missing.safetensors")], "no such file"),
                          (["--time-limit", "0"], "--time-limit must be a positive")]:
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err
    for argv, message in [(["--variants", "AdamW"], "--variants: unknown ['AdamW']"),
                          (["--time-budget", "-1"], "--time-budget must be"), (["--rho-share", "1"], "--rho-share")]:
        with pytest.raises(SystemExit):
            convergence.parse_args(argv)
        assert message in capsys.readouterr().err


def test_runs_are_compared_at_the_tokens_all_of_them_reached():
    """A run cut short counts up to its last common evaluation; gaps are paired by seed."""
    def run(variant, seed, curve):
        return {"variant": variant, "seed": seed, "val_curve": curve}

    results = [run(convergence.ADAMW, 0, [(10, 3.0), (20, 2.5), (30, 2.0)]),
               run(convergence.ADAMW, 1, [(10, 3.2), (20, 2.7), (30, 2.2)]),
               run(convergence.NO_RHO, 0, [(10, 3.1), (20, 2.6)])]  # partial
    stats = convergence.phase_stats(results)
    assert stats["at_tokens"] == 20
    rows = {r["variant"]: r for r in stats["rows"]}
    assert rows[convergence.ADAMW]["mean"] == pytest.approx(2.6)
    assert rows[convergence.NO_RHO]["gap"] == pytest.approx(0.1)  # against AdamW's seed 0, not its mean
    assert stats["seed_sd"] == pytest.approx(0.1 * 2**0.5)
    assert rows[convergence.NO_RHO]["gap_in_seed_sd"] == pytest.approx(0.1 / (0.1 * 2**0.5))
