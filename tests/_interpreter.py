"""Running Triton kernels on CPU under the interpreter, from a test module.

Triton chooses interpreted or compiled when a ``@triton.jit`` function is defined, its own library included:
one process is in one mode. A module that imports this one before anything imports triton, on a machine
without CUDA, turns the interpreter on for the process; where that did not take (CUDA is present and the GPU
tests need compiled kernels, or triton was imported first), ``run_interpreted`` runs the module's
interpreter tests in a child pytest process with ``TRITON_INTERPRET=1`` and no visible GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    triton = None

HAS_TRITON = triton is not None
IN_PROCESS = HAS_TRITON and isinstance(triton.language.max, InterpretedFunction)


SHARD_ENV = "FLASHDIST_TEST_SHARD"  # "i/n": a child process runs every n-th of its collected tests, from the i-th


def run_interpreted(test_file: str, *pytest_args: str, shards: int = 1) -> subprocess.CompletedProcess:
    """``pytest test_file *pytest_args`` in a child process that interprets triton. With ``shards`` > 1, that
    many children side by side, each with one CPU thread and every ``shards``-th test, at most one per core: the
    interpreter is single-threaded Python, so a long module finishes sooner on a machine with more cores. The
    result joins theirs: the first failing child's return code and every child's output."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (repo, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    shards = max(1, min(shards, len(os.sched_getaffinity(0))))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, *pytest_args]
    if shards == 1:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    children = [subprocess.Popen([*cmd, "-p", "_interpreter"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=dict(env, OMP_NUM_THREADS="1", **{SHARD_ENV: f"{i}/{shards}"}))
                for i in range(shards)]
    outputs = [child.communicate(timeout=1800) for child in children]
    code = next((c.returncode for c in children if c.returncode), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def pytest_collection_modifyitems(config, items):
    """As a plugin of a child of ``run_interpreted`` (``-p _interpreter``): keep this child's share of the tests."""
    shard = os.environ.get(SHARD_ENV)
    if shard:
        i, n = map(int, shard.split("/"))
        items[:] = items[i::n]
