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


def run_interpreted(test_file: str, *pytest_args: str) -> subprocess.CompletedProcess:
    """``pytest test_file *pytest_args`` in a child process that interprets triton."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, *pytest_args],
                          env=env, capture_output=True, text=True, timeout=1800)
