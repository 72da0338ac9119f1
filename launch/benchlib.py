"""Helpers shared by the training benchmarks (bench_fsdp.py, bench_deepspeed.py, bench_offload.py, bench_scaling.py,
bench_fit.py) and train.py."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

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


def free_memory(device: torch.device) -> None:
    """Give back what the last case or trial held: garbage collected, and on a GPU the allocator's cache
    emptied once the device is idle."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def write_json(path, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (its folder made first); nothing where ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))


def in_process_group(run: Callable, args):
    """``run(args)`` between the start and the end of torchrun's process group: NCCL on this rank's GPU, or gloo
    on the CPU (``args.cpu``, or no GPU)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


def rank_and_device() -> tuple[int, int, torch.device]:
    """This rank, the world size and the device of the process group: its GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def run_meta(args, world: int, device: torch.device, **extra) -> dict:
    """What a benchmark's JSON says about its run: date, versions, device, world size, arguments."""
    import datetime

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": vars(args)}
    if device.type == "cuda":
        import triton

        meta["triton"] = triton.__version__
    return {**meta, **extra}


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


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, as one optimizer (what FlashMuon is
    in one object): ``param_groups`` is both optimizers' groups, so one LR scheduler drives both.

    torch.optim.Muon is a one-device optimizer: under FSDP2 on one rank it steps the local tensors (each the
    whole matrix, sharing the DTensor's storage), which keeps DTensor dispatch out of Newton-Schulz."""

    def __init__(self, matrices, adamw_groups, **muon_kwargs):
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) and p.to_local().shape != p.shape for p in matrices):
            raise ValueError("--optimizer muon: torch.optim.Muon needs whole matrices; run it on one rank")
        self.matrices = matrices
        self.local = [p.to_local().detach() if isinstance(p, DTensor) else p for p in matrices]  # same storage
        self.muon = torch.optim.Muon(self.local, **muon_kwargs)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=muon_kwargs["lr"], betas=(0.9, 0.95), foreach=True)
        super().__init__([{"params": []}], {"lr": muon_kwargs["lr"]})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for p, local in zip(self.matrices, self.local):
            if p is not local:
                local.grad = None if p.grad is None else p.grad.to_local().detach()
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True):
        for p in self.matrices:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict):
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # torch's load_state_dict makes new group dicts: ours must be them, or a scheduler (and Accelerate, which
        # loads the state back when it wraps the optimizer) would set a learning rate nothing reads
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
