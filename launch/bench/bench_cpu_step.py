"""Time one optimizer step on the CPU: flashdist's fused CPU step next to torch's fused CPU AdamW.

    python launch/bench/bench_cpu_step.py --out runs/cpu_step.json                # all cores torch uses
    python launch/bench/bench_cpu_step.py --threads 2 --out runs/cpu_step_2.json  # the same on 2 threads
    python launch/bench/bench_cpu_step.py --scale 0.25                            # a quarter of the rows
    python launch/bench/bench_cpu_step.py --baseline /tmp/old/step.cpp            # and an earlier step, row by row
    python launch/bench/bench_cpu_step.py --threads 2 --scale 0.25 --interleave 30 --baseline /tmp/old/step.cpp

Workload: 157 M parameters in Llama-7B-like matrices, four of 4096 x 4096 and two of 4096 x 11008 (``--scale``
scales the row counts), random non-zero gradients. Each row is the median of ``--steps`` timed steps after
one warm-up step, timed around ``optimizer.step()``; "M params/s" is parameters over that median, "M params/cpu-s"
parameters over the median CPU time of the process (all threads): on a machine shared with other work the
wall time varies with their load, the CPU time much less.

Rows:
- torch.optim.AdamW(fused=True) on fp32 parameters (fp32 moments): the target.
- flashdist FlashAdamW, 24-bit (bf16 parameters, int8 rho, 8-bit companded moments: the default), and with
  fp32 parameters (8-bit moments, no split), with the fused CPU step (``backend="cpu"``).
- FlashSGD (momentum 0.9) and FlashLion, 24-bit, fused CPU step.
- FlashAdamW 24-bit with the eager reference (``backend="reference"``), the CPU path before the fused step;
  it is slow, so it runs on the first matrix only (``--reference-params`` rows limit it further).
- ``--baseline OLD/step.cpp``: each fused row again, right after it, with the step built from that source (an
  earlier version kept outside the repository), so that both see the same load on a shared machine.
- ``--interleave ROUNDS``: on a machine shared with other work, every row's optimizer is built first and
  the rows then take turns, two steps each per round, for ROUNDS rounds; a row's best step (and median) is
  reported, and its pace against torch's best. Other work slows torch's memory-bound step and flashdist's
  arithmetic-bound one differently, so rows timed minutes apart do not compare; rows that alternate do.
  The fused rows (and ``--baseline``) only; the reference rows are left out.
- ``--compile``: the eager reference under torch.compile (inductor's C++ backend) on the first matrix, the
  alternative the fused step was measured against; its first (compiling) step is reported separately.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import flashdist
from flashdist import FlashAdamW, FlashLion, FlashSGD
from flashdist.kernels import cpu as cpu_kernel

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2


def _shapes(scale: float):
    return [(max(1, int(r * scale)), c) for r, c in SHAPES]


def _params(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.02).to(dtype))
        p.grad = torch.randn(s, generator=gen).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def _time(opt, steps: int) -> tuple[float, float, float, float]:
    """(first step, then over ``steps`` more: median wall time, best wall time, median CPU time of the process,
    all threads) in seconds. On a shared machine the CPU time is the steadier measure of the work."""
    t0 = time.perf_counter()
    opt.step()
    first = time.perf_counter() - t0
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return first, statistics.median(wall), min(wall), statistics.median(cpu)


def _row(name, params, make, steps):
    n = sum(p.numel() for p in params)
    try:
        opt = make(params)
        first, med, best, cpu = _time(opt, steps)
    except Exception as e:  # a case this machine cannot run is a finding, not a crash
        return {"case": name, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"case": name, "params": n, "first_step_ms": first * 1e3, "step_ms": med * 1e3, "best_ms": best * 1e3,
            "cpu_ms": cpu * 1e3, "mparams_per_s": n / med / 1e6, "mparams_per_cpu_s": n / cpu / 1e6}


def _interleaved(cases, rounds: int) -> list[dict]:
    """cases: (name, params, make, module or None). Every optimizer is built and stepped once, then all take
    turns for ``rounds`` rounds of two steps; each row gets its best and median step."""
    built = [(name, params, make(params), module) for name, params, make, module in cases]
    times = {name: [] for name, *_ in built}
    for r in range(rounds + 1):
        for name, params, opt, module in built:
            with cpu_kernel.using(module) if module is not None else contextlib.nullcontext():
                for _ in range(2):
                    t0 = time.perf_counter()
                    opt.step()
                    if r:  # round 0 warms up (and builds the steps)
                        times[name].append(time.perf_counter() - t0)
    rows = []
    for name, params, _, _ in built:
        n = sum(p.numel() for p in params)
        best, med = min(times[name]), statistics.median(times[name])
        rows.append({"case": name, "params": n, "best_ms": best * 1e3, "step_ms": med * 1e3,
                     "mparams_per_s": n / best / 1e6, "steps": len(times[name])})
    torch_best = rows[0]["best_ms"]
    for row in rows:
        row["vs_torch"] = torch_best / row["best_ms"]
        print(f"{row['case']:<56} {row['params'] / 1e6:7.1f} M  best {row['best_ms']:8.2f} ms "
              f"(median {row['step_ms']:.2f})  {row['mparams_per_s']:8.1f} M params/s  vs torch {row['vs_torch']:.2f}",
              flush=True)
    return rows


def _reference_compiled(params):
    """The reference step under torch.compile: FlashAdamW's backend forced to the reference, its step
    compiled (graph breaks where dynamo cannot trace fall back to eager)."""
    opt = FlashAdamW(params, lr=1e-3, weight_decay=0.1, backend="reference")
    opt.step = torch.compile(opt.step)
    return opt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every matrix's row count by this")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--reference-rows", type=int, default=1024,
                    help="rows of the first matrix the slow eager reference (and --compile) runs on")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the eager reference")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a step.cpp (e.g. an earlier version) to build and time after each fused row")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="time the fused rows taking turns for this many rounds (best step per row)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and the machine as JSON here")
    args = ap.parse_args()
    baseline = cpu_kernel.build_from(args.baseline) if args.baseline else None
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = _shapes(args.scale)
    flash = dict(lr=1e-3, weight_decay=0.1)
    if args.interleave:
        cases = [("torch AdamW fused, fp32 params", _params(shapes, torch.float32),
                  lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True), None)]
        for name, dtype, make in [
                ("flashdist FlashAdamW 24-bit, fused CPU step", torch.bfloat16,
                 lambda ps: FlashAdamW(ps, **flash, backend="cpu")),
                ("flashdist FlashAdamW fp32 params, fused CPU step", torch.float32,  # fp32 on purpose
                 lambda ps: FlashAdamW(ps, **flash, master_weight_bits=None, backend="cpu")),
                ("flashdist FlashSGD m=0.9 24-bit, fused CPU step", torch.bfloat16,
                 lambda ps: FlashSGD(ps, lr=1e-3, momentum=0.9, backend="cpu")),
                ("flashdist FlashLion 24-bit, fused CPU step", torch.bfloat16,
                 lambda ps: FlashLion(ps, lr=1e-4, weight_decay=0.1, backend="cpu"))]:
            cases.append((name, _params(shapes, dtype), make, None))
            if baseline is not None:  # its own tensors, stepped by the baseline's step
                cases.append((f"{name} [baseline]", _params(shapes, dtype), make, baseline))
        rows = _interleaved(cases, args.interleave)
    else:
        rows = _sequential(args, shapes, baseline, flash)
    _finish(args, rows)


def _sequential(args, shapes, baseline, flash) -> list[dict]:
    small = [(min(args.reference_rows, shapes[0][0]), shapes[0][1])]
    rows = []

    def add(row):
        rows.append(row)
        if "error" in row:
            print(f"{row['case']:<48} error: {row['error']}", flush=True)
        else:
            print(f"{row['case']:<56} {row['params'] / 1e6:7.1f} M {row['step_ms']:9.1f} ms (best {row['best_ms']:.1f}) "
                  f"{row['mparams_per_s']:8.1f} M params/s  cpu {row['cpu_ms']:9.1f} ms "
                  f"{row['mparams_per_cpu_s']:8.1f} M params/cpu-s  (first step {row['first_step_ms']:.0f} ms)",
                  flush=True)

    def fused(name, shapes_, dtype, make):
        add(_row(name, _params(shapes_, dtype), make, args.steps))
        if baseline is not None:
            with cpu_kernel.using(baseline):
                add(_row(f"{name} [baseline]", _params(shapes_, dtype), make, args.steps))

    add(_row("torch AdamW fused, fp32 params", _params(shapes, torch.float32),
             lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True), args.steps))
    fused("flashdist FlashAdamW 24-bit, fused CPU step", shapes, torch.bfloat16,
          lambda ps: FlashAdamW(ps, **flash, backend="cpu"))
    fused("flashdist FlashAdamW fp32 params, fused CPU step", shapes, torch.float32,  # fp32 on purpose
          lambda ps: FlashAdamW(ps, **flash, master_weight_bits=None, backend="cpu"))
    fused("flashdist FlashSGD m=0.9 24-bit, fused CPU step", shapes, torch.bfloat16,
          lambda ps: FlashSGD(ps, lr=1e-3, momentum=0.9, backend="cpu"))
    fused("flashdist FlashLion 24-bit, fused CPU step", shapes, torch.bfloat16,
          lambda ps: FlashLion(ps, lr=1e-4, weight_decay=0.1, backend="cpu"))
    add(_row("torch AdamW fused, fp32 params (first matrix rows)", _params(small, torch.float32),
             lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True), args.steps))
    fused("flashdist FlashAdamW 24-bit, fused (first matrix rows)", small, torch.bfloat16,
          lambda ps: FlashAdamW(ps, **flash, backend="cpu"))
    add(_row("flashdist FlashAdamW 24-bit, eager reference", _params(small, torch.bfloat16),
             lambda ps: FlashAdamW(ps, **flash, backend="reference"), min(args.steps, 3)))
    if args.compile:
        add(_row("flashdist FlashAdamW 24-bit, torch.compile(reference)", _params(small, torch.bfloat16),
                 _reference_compiled, min(args.steps, 3)))

    return rows


def _finish(args, rows):
    target = next((r for r in rows if r["case"].startswith("torch AdamW") and "error" not in r), None)
    fused = next((r for r in rows if r["case"] == "flashdist FlashAdamW 24-bit, fused CPU step"), None)
    if target and fused and "error" not in fused and "mparams_per_cpu_s" in fused:
        print(f"\nflashdist 24-bit / torch fused AdamW fp32: params/s {fused['mparams_per_s'] / target['mparams_per_s']:.2f}"
              f", params/cpu-s {fused['mparams_per_cpu_s'] / target['mparams_per_cpu_s']:.2f}")
    if args.out:
        try:  # shared VMs often name only the vendor ("AMD EPYC"): the family and model tell them apart
            lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            fields = {k.strip(): v.strip() for k, sep, v in (ln.partition(":") for ln in lines) if sep}
        except OSError:
            fields = {}
        cpu_name = fields.get("Model name", platform.processor())
        machine = {"cpu": cpu_name, "cpu_family": fields.get("CPU family"), "cpu_model": fields.get("Model"),
                   "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                   "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                   "fused_step_isa": cpu_kernel.vector_isa(),
                   "flashdist": getattr(flashdist, "__version__", "?"), "python": platform.python_version(),
                   "date": datetime.date.today().isoformat()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "scale": args.scale, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
