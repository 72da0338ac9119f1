"""The one harness for multi-rank tests: run a function on N gloo ranks, each in its own CPU process.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, joins them in a gloo process group
(a FileStore in a temporary directory, so no port is needed), calls ``fn(rank, world_size, *args)`` in
each and returns the per-rank results as a list. A rank that raises makes ``run_ranks`` raise
``RankFailure`` with that rank's traceback; a run that exceeds ``timeout`` is killed and reported.

Processes come from a forkserver that has already imported torch, FSDP2, DCP, flashdist and torch._dynamo
(which fully_shard imports on first use), so a rank starts in a fraction of a second instead of seconds.
``fn`` and its arguments must be picklable (module-level functions); results travel back through
``torch.save``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "flashdist"]
_context: Any = None


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _get_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order."""
    import torch

    ctx = _get_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="flashdist-ranks-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world_size, os.path.join(tmp, "store"), fn, args, results),
                             daemon=True) for r in range(world_size)]
        for proc in procs:
            proc.start()
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) + len(failures) < world_size:
                if failures:  # the other ranks may wait forever on a collective: give them a moment only
                    deadline = min(deadline, time.monotonic() + 5.0)
                try:
                    rank, ok, payload = results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if p.exitcode not in (None, 0) and r not in values and r not in failures]
                    for r in dead:
                        failures[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                    if time.monotonic() >= deadline:
                        break
                    continue
                if ok:
                    values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    failures[rank] = payload
        finally:
            for proc in procs:
                proc.join(timeout=5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if failures:
        first = min(failures)
        raise RankFailure(f"{fn.__name__} on {world_size} ranks: rank {first} failed:\n{failures[first]}"
                          + (f"\n(ranks failing: {sorted(failures)})" if len(failures) > 1 else ""))
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise RankFailure(f"{fn.__name__} on {world_size} ranks: ranks {missing} gave no result within "
                          f"{timeout:.0f}s")
    return [values[r] for r in range(world_size)]
