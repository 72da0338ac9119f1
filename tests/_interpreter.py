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
import time
import zlib

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


SHARD_ENV = "FLASHDIST_TEST_SHARD"  # "i/n": a child process runs the tests whose id hashes to i modulo n


def run_interpreted(test_file: str, *pytest_args: str, shards: int = 1) -> subprocess.CompletedProcess:
    """``pytest test_file *pytest_args`` in a child process that interprets triton. With ``shards`` > 1, that
    many children side by side (at most one per core), each with one CPU thread and a share of the tests: the
    interpreter is single-threaded Python, so a long module finishes sooner on a machine with more cores. The
    result joins theirs: the first failing child's return code and every child's output, a failing child's
    last."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (repo, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH"))
                           if p)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shards = max(1, min(shards, cores))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, *pytest_args]
    if shards == 1:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    children = [subprocess.Popen([*cmd, "-p", "_interpreter"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=dict(env, OMP_NUM_THREADS="1", **{SHARD_ENV: f"{i}/{shards}"}))
                for i in range(shards)]
    deadline = time.monotonic() + 1800
    try:
        outputs = [child.communicate(timeout=max(1.0, deadline - time.monotonic())) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    codes = [child.returncode for child in children]
    ran = [c for c in codes if c != 5]  # pytest's 5: no test in this share (shares can be empty under -k)
    order = sorted(range(shards), key=lambda i: codes[i] not in (0, 5))  # a failing child's output last
    return subprocess.CompletedProcess(cmd, next((c for c in ran if c), 0) if ran else 5,
                                       "".join(outputs[i][0] for i in order), "".join(outputs[i][1] for i in order))


def pytest_collection_modifyitems(config, items):
    """As a plugin of a child of ``run_interpreted`` (``-p _interpreter``): keep this child's share of the tests."""
    shard = os.environ.get(SHARD_ENV)
    if shard:  # by a hash of the test's id: the same split in every child, whatever order each collects in
        i, n = map(int, shard.split("/"))
        items[:] = [item for item in items if zlib.crc32(item.nodeid.encode()) % n == i]
