"""Multi-node training, tested as two nodes on one host: torchrun agents on 127.0.0.1 joined by a c10d
rendezvous run launch/train.py (tiny model, gloo, CPU) under HSDP, resume its checkpoint on other node
counts, survive a rank that dies mid-run (torchrun --max-restarts brings the job back from its last
checkpoint) and a node whose agent dies (launch/multinode.sh starts it again, it rejoins the running job,
which continues from its last checkpoint). With ``--same-batch`` every rank reads the single-process run's
batch, so every layout must give that run's losses and checkpoint bit for bit: gradients reduced over copies
of one batch sum exactly, and the optimizer step on a shard is the step on the whole tensor.

Every agent runs in a process group of its own: a test that fails or times out kills them all."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # several torchrun jobs

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "launch" / "train.py")
STEPS = 6
TINY = ["--d-model", "32", "--n-layer", "1", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
        "--corpus-mb", "1", "--eval-every", "3", "--eval-batches", "2", "--log-every", "1", "--warmup", "2",
        "--steps", str(STEPS), "--threads", "1", "--same-batch", "--compute-dtype", "bf16", "--clip", "0",
        "--state-dict-format", "compressed"]
TIMEOUT = 240.0  # one job, from the first agent's start to the last agent's exit
# PYTHONFAULTHANDLER: a worker that crashes prints every thread's Python stack into its agent's log
ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1",
           PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent (a "node") in a session of its own, its output in a file."""

    def __init__(self, log: Path, argv: list[str], env: dict | None = None):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or ENV, cwd=ROOT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the agent and its workers, as a node that loses power. torchrun starts each worker in a
        session of its own, so the agent's process group alone would leave them running."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        self.proc.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class Cluster:
    """Agents started on 127.0.0.1, one c10d rendezvous (on a port of its own) per job name; every agent is
    killed when the block ends."""

    def __init__(self, tmp: Path):
        self.tmp, self.agents, self.ports = tmp, [], {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for agent in self.agents:
            agent.kill()

    def agent(self, name: str, nnodes: int | str, nproc: int, args: list[str], max_restarts: int = 0,
              host: bool = True) -> Agent:
        # is_host: the first agent serves the rendezvous store; the others, and a replacement, connect to it
        port = self.ports.setdefault(name, _free_port())
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
                f"--rdzv-conf=is_host={str(host).lower()},join_timeout=120", f"--max-restarts={max_restarts}",
                "--monitor-interval=0.5", TRAIN, *TINY, *args]
        agent = Agent(self.tmp / f"{name}-{len(self.agents)}.log", argv)
        self.agents.append(agent)
        return agent

    def job(self, name: str, nnodes: int, nproc: int, args: list[str]) -> list[Agent]:
        return [self.agent(name, nnodes, nproc, args, host=i == 0) for i in range(nnodes)]


def _wait(agents: list[Agent], deadline: float) -> None:
    for agent in agents:
        try:
            code = agent.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != 0:
            logs = "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in agents)
            raise AssertionError(f"{agent.log.name}: exit {code}\n{logs}")


def _wait_for(pattern: str, agents: list[Agent], deadline: float) -> None:
    while not any(re.search(pattern, a.output()) for a in agents):
        if time.monotonic() > deadline or any(a.proc.poll() is not None for a in agents):
            raise AssertionError(f"no {pattern!r} in time:\n" + "\n".join(a.output()[-2000:] for a in agents))
        time.sleep(0.05)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _checkpoint(path: Path) -> dict:
    """Every entry of a DCP checkpoint, as global tensors and plain values."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path.with_name(path.name + ".pt")
    dcp_to_torch_save(path, target)
    return _flat(torch.load(target, weights_only=False))


def _assert_same_run(out: Path, ckpt: Path, reference: tuple[list, dict], what: str) -> None:
    log, state = reference
    assert [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()] == log, what
    got = _checkpoint(ckpt / "latest")
    assert got.keys() == state.keys(), what
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), f"{what}: {key} differs"
        else:
            assert got[key] == want, f"{what}: {key} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list, dict]:
    """The single-process run: its per-step log and its final checkpoint."""
    tmp = tmp_path_factory.mktemp("one-process")
    proc = subprocess.run([sys.executable, TRAIN, *TINY, "--ckpt-dir", str(tmp / "ck"), "--ckpt-every",
                           str(STEPS), "--out-dir", str(tmp / "out")], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp / "out" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"], "the reference run does not learn"
    return log, _checkpoint(tmp / "ck" / "latest")


def test_hsdp_on_two_nodes_resumes_on_one_node_and_on_two_single_rank_nodes(tmp_path, reference):
    """2 nodes x 2 ranks (HSDP, 2 replicas x 2 shards) train 3 steps and save; the checkpoint resumes on
    1 node x 2 ranks (FSDP2) and on 2 nodes x 1 rank (HSDP, 2 replicas x 1 shard) to the end of the run."""
    deadline = time.monotonic() + 2 * TIMEOUT
    first = tmp_path / "2x2"
    with Cluster(tmp_path) as cluster:
        job = cluster.job("first", 2, 2, ["--stop-at", "3", "--ckpt-dir", str(first / "ck"), "--ckpt-every", "3",
                                          "--out-dir", str(first / "out")])
        _wait(job, deadline)
    summary = json.loads((first / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["mesh"], summary["steps"]) == (4, [2, 2], 3)
    assert "HSDP: 2 replicas x 2 shards" in job[0].output() + job[1].output()

    layouts = {"1x2": (1, 2, [1, 2]), "2x1": (2, 1, [2, 1])}
    with Cluster(tmp_path) as cluster:
        jobs = {}
        for name, (nnodes, nproc, _) in layouts.items():
            shutil.copytree(first / "ck", tmp_path / name / "ck")
            jobs[name] = cluster.job(name, nnodes, nproc, ["--ckpt-dir", str(tmp_path / name / "ck"),
                                                           "--ckpt-every", "3", "--auto-resume",
                                                           "--out-dir", str(tmp_path / name / "out")])
        for agents in jobs.values():
            _wait(agents, deadline)
    for name, (nnodes, nproc, mesh) in layouts.items():
        out = tmp_path / name / "out"
        summary = json.loads(out.joinpath("summary.json").read_text())
        assert (summary["world_size"], summary["mesh"], summary["resumed_from"]) == (nnodes * nproc, mesh, 3)
        _assert_same_run(out, tmp_path / name / "ck", reference, f"2x2 -> {name}")


def test_a_rank_killed_mid_run_is_restarted_by_torchrun_from_the_last_checkpoint(tmp_path, reference):
    """2 nodes x 2 ranks (HSDP) with --max-restarts 1 and --auto-resume; one rank of node 1 is killed after a
    checkpoint; both agents restart their workers, which resume from the last checkpoint and finish with the
    uninterrupted run's losses and state."""
    deadline = time.monotonic() + TIMEOUT
    args = ["--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "1", "--auto-resume", "--out-dir",
            str(tmp_path / "out")]
    with Cluster(tmp_path) as cluster:
        node0 = cluster.agent("elastic", 2, 2, args, max_restarts=1, host=True)
        node1 = cluster.agent("elastic", 2, 2, args, max_restarts=1, host=False)
        _wait_for(r"saved \S+ at step", [node0, node1], deadline)
        workers = [pid for pid in _descendants(node1.proc.pid) if "train.py" in _cmdline(pid)]
        os.kill(workers[0], signal.SIGKILL)
        _wait([node0, node1], deadline)
        output = node0.output() + node1.output()
    # TORCHELASTIC_RESTART_COUNT counts the restarts a node caused: rank 0's banner may not say "restart"
    starts = output.split("HSDP: 2 replicas x 2 shards")
    assert len(starts) == 3, "the job was not restarted once:\n" + output[-3000:]
    resumed = int(starts[2].split("resumed from")[1].split("at step")[1].split()[0])
    assert 1 <= resumed < STEPS, starts[2][-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["mesh"], summary["resumed_from"]) == (4, [2, 2], resumed)
    _assert_same_run(tmp_path / "out", tmp_path / "ck", reference, f"killed and resumed at step {resumed}")


@pytest.mark.parametrize("killed, store", [(1, "first agent"), (0, "own process")],
                         ids=["node1-agent-store", "node0-own-store"])
def test_a_node_whose_agent_is_killed_is_started_again_and_the_job_resumes(tmp_path, reference, killed, store):
    """launch/multinode.sh on 2 nodes x 1 rank; one node's torchrun agent and its worker are killed (SIGKILL)
    after a checkpoint, and that node's multinode.sh (AGENT_RESTARTS=1, the supervisor) starts its agent again:
    the other agent, whose worker failed with it, meets it in a new rendezvous round, and the job continues from
    the last checkpoint to the uninterrupted run's losses and state. Node 1 dies while node 0's agent serves the
    rendezvous store (torchrun's default); node 0 dies while the store is a process of its own (RDZV_STORE)."""
    deadline = time.monotonic() + TIMEOUT
    settings = dict(ENV, NNODES="2", NPROC_PER_NODE="1", RDZV_HOST="127.0.0.1", RDZV_PORT=str(_free_port()),
                    JOB_ID="elastic", MAX_RESTARTS="1", CKPT_DIR=str(tmp_path / "ck"), CKPT_EVERY="1",
                    PYTHON=sys.executable)
    # is_host: without RDZV_STORE node 0's agent serves the store (both nodes would match 127.0.0.1)
    nodes = [dict(settings, RDZV_STORE="serve"), dict(settings, RDZV_STORE="join")] if store == "own process" else \
        [dict(settings, RDZV_CONF="is_host=true"), dict(settings, RDZV_CONF="is_host=false")]
    nodes[killed]["AGENT_RESTARTS"] = "1"
    argv = ["bash", str(ROOT / "launch" / "multinode.sh"), *TINY, "--out-dir", str(tmp_path / "out")]
    with Cluster(tmp_path) as cluster:
        cluster.agents += [Agent(tmp_path / f"node{i}.log", argv, env) for i, env in enumerate(nodes)]
        _wait_for(r"saved \S+ at step", cluster.agents, deadline)
        victim = cluster.agents[killed]
        for pid in _descendants(victim.proc.pid):  # the agent and its worker; multinode.sh and the store live on
            if "launch.rdzv_store" not in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _wait(cluster.agents, deadline)
        output = "".join(agent.output() for agent in cluster.agents)
    assert "starting it again (1 of 1)" in victim.output(), victim.output()[-3000:]
    starts = output.split("HSDP: 2 replicas x 1 shards")
    assert len(starts) == 3, "the job was not restarted once:\n" + output[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["world_size"], summary["mesh"]) == (2, [2, 1]) and 1 <= summary["resumed_from"] < STEPS
    _assert_same_run(tmp_path / "out", tmp_path / "ck", reference,
                     f"node {killed} back at step {summary['resumed_from']}")


# A rank of launch/train.py that leaves the process group. Rank 1 takes its time to shut down (a slow
# destroy_process_group) and says when it is done; with "lost", rank 1 reports to a store namespace rank 0 does
# not read, as a rank that never arrives. Each process prints when it has closed.
_CLOSE = """
import sys, time
import torch.distributed as dist
from launch.train import Run

run = Run(threads=1)
if run.rank == 1:
    destroy = dist.destroy_process_group

    def slow_destroy():
        time.sleep(1.5)
        destroy()
        print("destroyed", time.time(), flush=True)

    dist.destroy_process_group = slow_destroy
    if sys.argv[1] == "lost":
        run.store = dist.PrefixStore("elsewhere", run.store)
run.close(timeout=float(sys.argv[2]))
print("closed", time.time(), flush=True)
"""


def _close_two_ranks(mode: str, timeout: float) -> list[str]:
    """Two ranks of train.py's Run, the workers' store served by rank 0's process (as under
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): each one's output."""
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-c", _CLOSE, mode, str(timeout)], env=dict(env, RANK=str(r)),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    return outputs


def _stamp(output: str, word: str) -> float:
    return float(re.search(rf"^{word} (\S+)$", output, re.M).group(1))


def test_rank_0_which_serves_the_workers_store_closes_after_every_other_rank():
    """Run.close on rank 0 returns (and its process, the store's server, exits) only after rank 1 has destroyed
    its process group, however long that takes."""
    rank0, rank1 = _close_two_ranks("slow", timeout=60)
    assert _stamp(rank0, "closed") >= _stamp(rank1, "destroyed"), (rank0, rank1)


def test_rank_0_stops_waiting_for_a_rank_that_never_closes_after_the_timeout():
    """A rank that does not report (stuck or gone) holds rank 0 for the timeout only, with one line that says so."""
    t0 = time.time()
    rank0, _ = _close_two_ranks("lost", timeout=2)
    assert "train.py: not every rank had closed its process group after 2 s; rank 0 exits anyway" in rank0, rank0
    assert 2 <= _stamp(rank0, "closed") - t0 < 30, rank0


def test_a_finished_rank_ends_without_the_interpreters_shutdown():
    """train.py ends a finished run with exit_now: its output flushed, its exit code kept, and no interpreter
    shutdown (an atexit handler does not run), during which gloo's worker threads, still releasing the last
    collective, would be stopped mid-release and abort the process."""
    script = ("import atexit, sys\nfrom launch.benchlib import exit_now\natexit.register(print, 'shutdown ran')\n"
              "print('trained', end='')\nsys.stderr.write('closed')\nexit_now(3)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "trained", "closed")
