"""Smoke runs of the training recipe: 2 ranks (FSDP2, gloo), a tiny model, a checkpoint, a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--n-layer", "1", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
        "--corpus-mb", "1", "--eval-every", "3", "--eval-batches", "2", "--log-every", "1", "--warmup", "2"]

pytestmark = pytest.mark.slow


def _train(*args, nproc=2):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "launch" / "train.py"), *TINY, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_train_checkpoint_resume_continues_the_curve(tmp_path):
    straight = tmp_path / "straight"
    stdout = _train("--steps", "6", "--out-dir", str(straight))
    assert "final val loss" in stdout and "B/param" in stdout
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert 6.5 < summary["bytes_per_param"] < 7.5  # bf16 + rho + grads + 8-bit moments, 1-d params in fp32
    assert (straight / "loss.png").stat().st_size > 1000

    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    _train("--steps", "6", "--stop-at", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--out-dir", str(resumed))
    assert (ckpt / "latest" / ".metadata").exists()
    stdout = _train("--steps", "6", "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--resume", "--out-dir", str(resumed))
    assert "resumed from" in stdout
    a, b = _log(straight), _log(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    # the resumed run continues exactly where the uninterrupted one went: same data, exact checkpoint
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["val_loss"] == b[-1]["val_loss"]
    assert 0 < a[-1]["bf16_moved"] <= 1  # counted over both ranks' shards


def test_adamw_and_release_variants_run(tmp_path):
    _train("--optimizer", "adamw", "--steps", "2", "--out-dir", str(tmp_path / "adamw"))
    assert json.loads((tmp_path / "adamw" / "summary.json").read_text())["bytes_per_param"] == pytest.approx(16.0)
    _train("--grad-release", "--clip", "0", "--steps", "2", "--out-dir", str(tmp_path / "release"))
    summary = json.loads((tmp_path / "release" / "summary.json").read_text())
    assert summary["memory_report"]["grads"] == 0


def test_flash_sgd_trains(tmp_path):
    """--optimizer flash_sgd with its defaults (lr 0.1, momentum 0.9): the loss falls; one 8-bit moment."""
    _train("--optimizer", "flash_sgd", "--steps", "6", "--out-dir", str(tmp_path / "sgd"))
    summary = json.loads((tmp_path / "sgd" / "summary.json").read_text())
    assert summary["optimizer"] == "flash_sgd" and 5.5 < summary["bytes_per_param"] < 6.5  # AdamW's: 6.5-7.5
    log = _log(tmp_path / "sgd")
    assert log[-1]["loss"] < log[0]["loss"] - 0.5  # measured 5.55 -> 4.21
    assert log[-1]["val_loss"] < log[2]["val_loss"]


# every file of launch/ and launch/bench/ with a command line, as a module name under launch; summarize.py
# takes two summary files and has no options
RECIPES = sorted(f.relative_to(ROOT / "launch").with_suffix("").as_posix().replace("/", ".")
                 for f in (*(ROOT / "launch").glob("*.py"), *(ROOT / "launch" / "bench").glob("*.py"))
                 if "__main__" in f.read_text() and f.stem != "summarize")
# the recipes import their sibling files one way as a module and another as a file; the other tests run
# train.py, train_deepspeed.py, bench_fsdp.py, bench_offload.py and bench_scaling.py as files
AS_FILE_ONLY_HERE = ["bench/bench_deepspeed"]
# what `python -m launch.NAME --help` does, for all recipes in one process (one torch import, not fourteen)
RUN_AS_MODULES = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv, out = [name, "--help"], io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("launch." + name, run_name="__main__", alter_sys=True)
        except SystemExit as done:
            assert done.code in (0, None), (name, done.code)
    assert "usage:" in out.getvalue(), name
"""


def test_every_recipe_runs_as_a_module():
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", RUN_AS_MODULES, *RECIPES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert len(RECIPES) >= 14 and proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", AS_FILE_ONLY_HERE)
def test_recipe_runs_as_a_file(name):
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / f"{name}.py"), "--help"], cwd=ROOT.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-3000:]


def test_bad_options_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--grad-release"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--clip 0" in proc.stderr


def test_optimizer_defaults_and_refusals(capsys):
    """Per-optimizer default lr / weight decay, explicit values win, `flash` is FlashAdamW's old name."""
    from launch import train

    parse = train.parse_args
    assert (parse([]).optimizer, parse([]).lr, parse([]).weight_decay) == ("flash_adamw", 3e-3, 0.1)
    assert parse(["--optimizer", "flash"]).optimizer == "flash_adamw"
    lion = parse(["--optimizer", "flash_lion"])
    assert (lion.lr, lion.weight_decay) == (1e-3, 0.3)
    sgd = parse(["--optimizer", "flash_sgd", "--weight-decay", "0"])
    assert (sgd.lr, sgd.weight_decay, sgd.momentum) == (0.1, 0.0, 0.9)
    assert parse(["--optimizer", "flash_sgd", "--lr", "0.5", "--momentum", "0"]).lr == 0.5
    with pytest.raises(SystemExit):
        parse(["--optimizer", "flash_lion", "--momentum", "0.5"])
    assert "--momentum is a flash_sgd option" in capsys.readouterr().err


def test_deepspeed_recipe_trains_and_resumes(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra; launch/setup.sh installs it")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(ROOT / "launch" / "train_deepspeed.py"), "--config", str(ROOT / "launch" / "configs" /
                                                                           "zero2_bf16_master.json"),
            "--d-model", "32", "--n-layer", "1", "--n-head", "2", "--seq-len", "32", "--micro-batch", "2",
            "--corpus-mb", "1", "--eval-batches", "1", "--log-every", "1", "--steps", "4",
            "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2", "--out-dir", str(tmp_path / "out")]
    for extra in (["--stop-at", "2"], ["--resume"]):
        proc = subprocess.run(base + extra, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _log(tmp_path / "out")
    assert [r["step"] for r in rows][-2:] == [3, 4] and all(r["loss"] == r["loss"] for r in rows)


def test_mesh_defaults_to_one_replica_group_per_node_and_refuses_shapes_that_miss_ranks():
    from launch import train

    assert train.mesh_shape(16, 8) == (2, 8)  # HSDP: replicate across the 2 nodes, shard within each
    assert train.mesh_shape(2, 2) == (1, 2)  # one node: plain FSDP2
    assert train.mesh_shape(16, 8, replicas=1) == (1, 16)  # FSDP2 across nodes
    assert train.mesh_shape(16, 8, shards=4) == (4, 4)
    assert train.mesh_shape(16, 8, replicas=2, shards=8) == (2, 8)
    for kwargs, flag in [(dict(replicas=3), "--replicas 3"), (dict(replicas=2, shards=4), "--shards 4"),
                         (dict(shards=5), "--shards 5")]:
        with pytest.raises(ValueError, match=flag):
            train.mesh_shape(16, 8, **kwargs)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        train.mesh_shape(6, 4)


def test_mesh_and_resume_flags_are_checked(capsys):
    from launch import train

    for argv, message in [(["--auto-resume"], "need --ckpt-dir"), (["--replicas", "0"], "--replicas must be"),
                          (["--shards", "-2"], "--shards must be"), (["--threads", "0"], "--threads must be"),
                          (["--optimizer", "muon", "--ckpt-dir", "ck"], "use --optimizer flash_muon")]:
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_mesh_that_misses_ranks_stops_the_job_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "launch" / "train.py"), *TINY, "--steps", "1", "--replicas", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--replicas 3 x --shards ? does not cover the 2 ranks" in proc.stderr
    assert not (tmp_path / "log.jsonl").exists()


def test_auto_resume_starts_fresh_without_a_checkpoint_and_continues_with_one(tmp_path):
    ck = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2", "--auto-resume"]
    stdout = _train("--steps", "4", "--stop-at", "2", *ck, "--out-dir", str(tmp_path / "a"))
    assert "resumed from" not in stdout and "FSDP2 over 2 ranks" in stdout
    stdout = _train("--steps", "4", *ck, "--out-dir", str(tmp_path / "a"))
    assert "at step 2" in stdout.split("resumed from")[1].splitlines()[0]
    assert [r["step"] for r in _log(tmp_path / "a")] == [1, 2, 3, 4]


def _benchmark_rows() -> dict[tuple[str, int], float]:
    """persistent GiB/rank of the measured Llama-3.1-8B rows in docs/benchmarks.md, by (optimizer, ranks)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("# Llama-3.1-8B shapes under FSDP2")[1].split("\n# ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 4 and cells[1].isdigit():
            rows[(cells[0], int(cells[1]))] = float(cells[3])
    return rows


def test_memory_budget_reproduces_the_measured_8b_rows(tmp_path):
    """launch/bench/memory_budget.py's persistent GiB per GPU equal the measured 8B rows of docs/benchmarks.md."""
    from launch.bench import memory_budget

    measured = _benchmark_rows()
    names = {"torch.optim.AdamW, fp32 master weights": "AdamW (fp32 master)", "FlashAdamW 24-bit": "FlashAdamW",
             "FlashAdamW 24-bit + gradient release": "FlashAdamW + release"}
    assert {name for name, _ in measured} == set(names) and {n for _, n in measured} == {1, 2}
    for (name, ranks), gib in measured.items():
        row = memory_budget.budget("Llama-3.1-8B", ranks)
        assert abs(row["optimizers"][names[name]]["persistent_gib"] - gib) <= 0.1, (name, ranks)
    rows = memory_budget.main(["--out", str(tmp_path / "budget.json")])
    assert json.loads((tmp_path / "budget.json").read_text())["rows"] == json.loads(json.dumps(rows))
    hsdp = memory_budget.budget("Llama-3.1-70B", 64, hsdp=True)
    fsdp = memory_budget.budget("Llama-3.1-70B", 64)
    assert (hsdp["replicas"], hsdp["shards"], fsdp["shards"]) == (8, 8, 64)
    assert hsdp["between_nodes_gib"] < fsdp["between_nodes_gib"] / 7  # HSDP's point: little inter-node traffic


def test_memory_budget_refuses_gpu_counts_that_are_not_whole_nodes(capsys):
    from launch.bench import memory_budget

    with pytest.raises(SystemExit):
        memory_budget.main(["--gpus", "12"])
    assert "--gpus [12] are not multiples of --gpus-per-node 8" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["8b", "tiny"])
def test_memory_budget_counts_the_parameters_of_the_benchmark_model(model):
    """The analytic Llama shape (flashdist.memory_plan's) counts what launch/llama.py builds (on the meta device)."""
    from flashdist.memory_plan import Shape
    from launch.bench import memory_budget
    from launch.llama import Llama, LlamaConfig

    import torch

    c = LlamaConfig.named(model)
    with torch.device("meta"):
        built = sum(p.numel() for p in Llama(c).parameters())
    shape = Shape(hidden=c.hidden, layers=c.layers, heads=c.heads, kv_heads=c.kv_heads, mlp=c.mlp,
                  vocab=c.vocab)
    assert shape.params() == built
    if model == "8b":
        assert shape == memory_budget.MODELS["Llama-3.1-8B"]


def test_multinode_scripts_parse_and_refuse_missing_settings():
    for script in ("multinode.sh", "slurm/train.sbatch"):
        assert subprocess.run(["bash", "-n", str(ROOT / "launch" / script)]).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "RDZV_HOST", "CKPT_DIR")}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "multinode.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "set NNODES" in proc.stderr
    env.update(NNODES="2", RDZV_HOST="127.0.0.1", CKPT_DIR="/nonexistent/ck", NPROC_PER_NODE="1", RDZV_STORE="yes")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "multinode.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "multinode.sh: RDZV_STORE=yes: use serve (on the RDZV_HOST node) or join (elsewhere)"]
    env.update(RDZV_STORE="join", AGENT_RESTARTS="two")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "multinode.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "multinode.sh: AGENT_RESTARTS=two: give a whole number (0: never)"]


def test_rdzv_store_refuses_a_taken_port_in_one_line():
    """launch/rdzv_store.py (multinode.sh RDZV_STORE=serve) on a port that something already listens on."""
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "launch.rdzv_store", "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"rdzv_store: cannot serve on port {port} (") and "choose another --port" in proc.stderr


def test_offload_benchmark_runs_and_measures_host_bytes(tmp_path):
    """launch/bench/bench_offload.py on the CPU: DeepSpeed ZeRO-Offload with FlashAdamW and FSDP2 CPUOffloadPolicy
    with torch's AdamW and FlashAdamW; the host bytes per parameter it measures are the documented ones."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra; launch/setup.sh installs it")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    out = tmp_path / "offload.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launch" / "bench" / "bench_offload.py"), "--model", "tiny", "--cpu", "--seq", "32", "--batch", "2",
           "--warmup", "1", "--steps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["ds_flash", "fsdp2_adamw", "fsdp2_flash"]  # DeepSpeedCPUAdam needs its C++ op
    assert rows["ds_flash"]["host_optimizer_bytes_per_param"] == 6.125  # fp32 masters + 8-bit moments
    assert rows["fsdp2_adamw"]["host_optimizer_bytes_per_param"] == 12.0  # fp32 parameters + fp32 moments
    # bf16 parameters + rho + 8-bit moments; the 1-D norm weights keep fp32 moments
    assert 5.125 < rows["fsdp2_flash"]["host_optimizer_bytes_per_param"] < 5.2


def test_docs_results_index_names_every_file_and_only_files_that_exist():
    """docs/results/README.md is the index of the measured figures: each file there has a row (a row may name
    several, ``name-{a,b}.json``), and each row names files that exist."""
    import re

    folder = ROOT / "docs" / "results"
    named = set()
    for line in (folder / "README.md").read_text().splitlines():
        cell = line.split("|")[1].strip() if line.startswith("| ") else ""
        for name in filter(None, (n.strip() for n in cell.split(", ") if n.strip().endswith(".json"))):
            braces = re.search(r"\{([^}]*)\}", name)
            named.update([name.replace(braces.group(0), part) for part in braces.group(1).split(",")] if braces
                         else [name])
    files = {p.name for p in folder.iterdir() if p.name != "README.md"}
    assert not files - named, f"docs/results files without a row in its README.md: {sorted(files - named)}"
    assert not named - files, f"docs/results/README.md names files that are not there: {sorted(named - files)}"
