"""Helpers shared by the training benchmarks (bench_fsdp.py, bench_deepspeed.py, bench_offload.py) and train.py."""

from __future__ import annotations

import gc
import os
import statistics
import sys
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


def exit_now(code: int = 0):
    """Flush stdout and stderr and end the process at once, without the interpreter's shutdown.

    A run (train.py, a distributed benchmark) ends this way once everything it writes is closed and its process group destroyed. torch's gloo
    process groups outlive ``destroy_process_group`` (FSDP2 and the device mesh hold them) with their worker
    threads, and such a thread drops its reference to a finished collective only after the rank has moved on
    (``ProcessGroupGloo::runLoop``). When the collective's tensors have Python objects, dropping it takes the
    GIL (``TensorImpl::decref_pyobject``); if the interpreter is shutting down by then, CPython ends the thread
    with ``pthread_exit``, whose unwinding through the work's destructor calls ``std::terminate``: the rank
    aborts ("terminate called without an active exception") after a finished run, and torchrun counts a
    failed worker. Not shutting the interpreter down leaves those threads nothing to trip over."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
