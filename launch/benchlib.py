"""Helpers shared by the training benchmarks (bench_fsdp.py, bench_deepspeed.py)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def run_or_record(case: str, run: Callable[[], dict], device: torch.device) -> dict:
    """The row ``run()`` returns or, when it raises, a row that records the error: a case this machine cannot
    run (a peer a backend refuses, an out-of-memory case) is a finding of the benchmark, not a crash of it.
    The memory a failed case held is given back first."""
    try:
        return run()
    except Exception as e:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"case": case, "error": f"{type(e).__name__}: {e}"[:400]}
