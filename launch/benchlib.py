"""Helpers shared by the training benchmarks (bench_fsdp.py, bench_deepspeed.py, bench_offload.py)."""

from __future__ import annotations

import gc
import statistics
import time
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


def timed_steps(step: Callable[[], torch.Tensor], warmup: int, steps: int, device: torch.device) -> dict:
    """Run ``step`` (one training step, returning its loss) ``warmup + steps`` times; the timed steps are the
    last ``steps``, each between device synchronisations, and the CUDA peak-memory counter is reset when they
    start. Returns their median and minimum in ms and the first and last losses."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
            "first_loss": losses[0], "last_loss": losses[-1]}
