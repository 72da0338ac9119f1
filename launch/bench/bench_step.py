"""Time one optimizer step on one GPU: flashdist's optimizers next to torch's fused ones and flashoptim.

Run on a GPU machine from the repository root:

    python launch/bench/bench_step.py --out bench_step.json [--sweep]

Workloads: the Llama-3.2-1B parameter shapes (1,236 M parameters, 147 tensors) and 2,000 tensors of
256 x 256 (131 M parameters). Each row is the median of 20 steps after 5 warm-up steps, timed with CUDA
events around ``optimizer.step()`` (so host work that leaves the GPU idle counts), on random non-zero
gradients. "B/param" is what the step must read and write per parameter; the floor is those bytes over
the measured device-to-device copy bandwidth (read + write), and "of floor" is floor / time.

Rows:
- flashdist FlashAdamW, 24-bit (bf16 params, int8 rho, 8-bit moments): the optimizer class, and
  "flashdist kernel only": the functional step (``flashdist.functional.flash_adam``) on the same
  tensors, without the optimizer's per-parameter bookkeeping; its host time per call is reported too. Each
  in the kernel's two variants: "exact" (IEEE division and square root, bitwise equal to the eager
  reference; the default) and "approx" (the GPU's approximate ones: FLASHDIST_EXACT=0). "capturable": the
  class built with ``capturable=True`` (step count and scalars on the device), stepped eagerly;
  "GraphedStep": the same, its step captured once in a CUDA graph and replayed (``flashdist.GraphedStep``).
- torch.optim.AdamW(fused=True) with fp32 and with bf16 parameters (moments in the parameter dtype).
- flashoptim 0.1.4 FlashAdamW, 24-bit, when ``import flashoptim`` works (else the row says so).
- the rest of the family: flashdist FlashSGD (momentum 0.9) and FlashLion, 24-bit, one 8-bit moment,
  next to torch.optim.SGD(momentum=0.9, fused=True) with fp32 and bf16 parameters.

``--sweep`` also times the kernel-only step, both variants, under a few launch configurations
(``flashdist.kernels.triton.LaunchConfig``): groups per block, blocks per program, warps, the L2 prefetch,
register caps, large-tensor threshold. ``--graphed`` sweeps an optimizer class through GraphedStep instead
(``--optimizer``), ``--rounds`` times every configuration that many times round by round, and ``--pause`` lets
the GPU idle before each timing (a card that heats up under a long sweep slows the configurations timed last):

    python launch/bench/bench_step.py --sweep-only --graphed --rounds 5 --pause 1 --workloads llama-3.2-1b \
        --variants exact --configs default "8 groups, 1 warp, 32 blocks" "at most 80 registers"
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time

import torch

import flashdist  # noqa: E402
from flashdist.functional.adam import flash_adam  # noqa: E402
from flashdist.kernels.triton import DEFAULT, using  # noqa: E402
from flashdist.quant import codes as Q  # noqa: E402

WARMUP, ITERS = 5, 20
LR = 1e-4


def llama_1b_shapes():
    h, inter, kv, vocab, layers = 2048, 8192, 512, 128256, 16
    shapes = [(vocab, h)]
    for _ in range(layers):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return shapes + [(h,)]


def small_shapes():
    return [(256, 256)] * 2000


WORKLOADS = {"llama-3.2-1b": llama_1b_shapes, "2000x256x256": small_shapes}


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 10)."""
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_cuda(lambda: b.copy_(a), warmup=3, iters=10)[0]
    del a, b
    return 2 * n / (ms / 1e3)


def time_cuda(fn, warmup=WARMUP, iters=ITERS):
    """(median, min, max) milliseconds of ``fn`` between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times), max(times)


def make_params(shapes, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).to(dtype))
        p.grad = (torch.randn(s, device="cuda", generator=gen) * 1e-3).to(dtype)
        params.append(p)
    return params


def flashdist_bytes(shapes, moments: int = 2) -> float:
    """Bytes a 24-bit flashdist step moves: per value, read param 2 + grad 2 + rho 1, write param 2 + rho 1;
    per moment (2 for FlashAdamW, 1 for FlashSGD with momentum and FlashLion), 2-d+ tensors read and write
    8-bit codes (1 + 1) with a bf16 scale per 32 values, 1-d ones fp32 moments (4 + 4)."""
    total = 0.0
    for s in shapes:
        n = torch.Size(s).numel()
        layout = Q.quantized_layout(s)
        moment = 2 * (n + 2 * layout[0] * layout[2]) if layout else 2 * 4 * n
        total += 8 * n + moments * moment
    return total


def one_moment_bytes(shapes) -> float:
    return flashdist_bytes(shapes, moments=1)


class KernelOnly:
    """The functional step on the tensors a FlashAdamW would hold, in two calls (quantized 2-d+ tensors,
    fp32-moment 1-d tensors), as the optimizer makes them, minus its bookkeeping."""

    def __init__(self, params, exact: bool = True):
        self.config = DEFAULT.replace(exact=exact)  # the launch configuration of its steps
        self.calls = []
        for quantized in (True, False):
            ps = [p for p in params if (Q.quantized_layout(p.shape) is not None) == quantized]
            if not ps:
                continue
            args = dict(params=[p.detach() for p in ps], grads=[p.grad for p in ps],
                        rhos=[torch.zeros_like(p, dtype=torch.int8) for p in ps])
            if quantized:
                layouts = [Q.quantized_layout(p.shape) for p in ps]
                args.update(exp_avgs=[torch.zeros_like(p, dtype=torch.int8) for p in ps],
                            exp_avg_sqs=[torch.zeros_like(p, dtype=torch.uint8) for p in ps],
                            exp_avg_scales=[p.new_zeros((r, g)) for p, (r, _, g) in zip(ps, layouts)],
                            exp_avg_sq_scales=[p.new_zeros((r, g)) for p, (r, _, g) in zip(ps, layouts)],
                            cols=[c for _, c, _ in layouts])
            else:
                args.update(exp_avgs=[torch.zeros_like(p, dtype=torch.float32) for p in ps],
                            exp_avg_sqs=[torch.zeros_like(p, dtype=torch.float32) for p in ps],
                            exp_avg_scales=None, exp_avg_sq_scales=None, cols=None)
            self.calls.append(args)
        self.skipped = torch.zeros((), dtype=torch.int32, device="cuda")
        self.t = 0

    def step(self):
        self.t += 1
        with using(self.config):
            for a in self.calls:
                flash_adam(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["exp_avg_scales"],
                           a["exp_avg_sq_scales"], a["rhos"], cols=a["cols"], lr=LR, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.01, step=self.t, decoupled=True, skipped=self.skipped,
                           backend="triton")

    def host_ms(self, iters=50) -> float:
        """Host time of one step with the launch plans cached (no synchronisation inside)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / iters * 1e3


class WithVariant:
    """An optimizer whose steps run the kernel variant ``exact``; with ``graphed``, through
    ``flashdist.GraphedStep`` (the optimizer built with ``capturable=True``): the first warm-up step runs
    eagerly, the second captures the step in a CUDA graph, and the timed steps replay it, each after the
    checks that make a replay safe (gradient and parameter addresses, hyper-parameters)."""

    def __init__(self, opt, exact: bool, graphed: bool = False):
        self.opt, self.config = opt, DEFAULT.replace(exact=exact)
        self.call = flashdist.GraphedStep(opt) if graphed else opt.step

    def step(self):
        with using(self.config):
            self.call()


def flashoptim_factory():
    try:
        import flashoptim
    except ImportError as e:
        return None, f"not importable ({e}); pip install flashoptim==0.1.4"
    version = getattr(flashoptim, "__version__", "?")
    return (lambda ps: flashoptim.FlashAdamW(ps, lr=LR, master_weight_bits=24)), f"flashoptim {version}"


def cases():
    """name -> (param dtype, factory or None, bytes-per-step function, note)."""
    fo, fo_note = flashoptim_factory()
    def per_value(b):
        return lambda shapes: b * sum(torch.Size(s).numel() for s in shapes)

    # torch: AdamW reads p, g, m, v and writes p, m, v (7 values); SGD with momentum reads p, g, buf, writes p, buf
    torch_bytes = {torch.float32: per_value(28.0), torch.bfloat16: per_value(14.0)}
    torch_sgd_bytes = {torch.float32: per_value(20.0), torch.bfloat16: per_value(10.0)}
    return {
        "flashdist FlashAdamW 24-bit, exact": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashAdamW(ps, lr=LR), True), flashdist_bytes, ""),
        "flashdist FlashAdamW 24-bit, approx": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashAdamW(ps, lr=LR), False), flashdist_bytes, ""),
        "flashdist FlashAdamW 24-bit, exact, capturable": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashAdamW(ps, lr=LR, capturable=True), True),
            flashdist_bytes, ""),
        "flashdist FlashAdamW 24-bit, exact, GraphedStep": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashAdamW(ps, lr=LR, capturable=True), True, True),
            flashdist_bytes, ""),
        "flashdist FlashAdamW 24-bit, approx, GraphedStep": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashAdamW(ps, lr=LR, capturable=True), False, True),
            flashdist_bytes, ""),
        "flashdist kernel only, exact": (torch.bfloat16, lambda ps: KernelOnly(ps, True), flashdist_bytes, ""),
        "flashdist kernel only, approx": (torch.bfloat16, lambda ps: KernelOnly(ps, False), flashdist_bytes, ""),
        "torch AdamW fused fp32": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
                                   torch_bytes[torch.float32], ""),
        "torch AdamW fused bf16": (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
                                   torch_bytes[torch.bfloat16], ""),
        "flashoptim FlashAdamW 24-bit": (torch.bfloat16, fo,
                                         lambda shapes: 12.25 * sum(torch.Size(s).numel() for s in shapes), fo_note),
        "flashdist FlashSGD 24-bit, momentum 0.9": (
            torch.bfloat16, lambda ps: flashdist.FlashSGD(ps, lr=LR, momentum=0.9), one_moment_bytes, ""),
        "flashdist FlashSGD 24-bit, momentum 0.9, GraphedStep": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashSGD(ps, lr=LR, momentum=0.9, capturable=True), True,
                                                   True), one_moment_bytes, ""),
        "flashdist FlashLion 24-bit": (torch.bfloat16, lambda ps: flashdist.FlashLion(ps, lr=LR), one_moment_bytes, ""),
        "flashdist FlashLion 24-bit, GraphedStep": (
            torch.bfloat16, lambda ps: WithVariant(flashdist.FlashLion(ps, lr=LR, capturable=True), True, True),
            one_moment_bytes, ""),
        "torch SGD fused fp32, momentum 0.9": (
            torch.float32, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, fused=True),
            torch_sgd_bytes[torch.float32], ""),
        "torch SGD fused bf16, momentum 0.9": (
            torch.bfloat16, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, fused=True),
            torch_sgd_bytes[torch.bfloat16], ""),
    }


def run_case(name, dtype, factory, nbytes, note, workload, shapes, bw):
    nparams = sum(torch.Size(s).numel() for s in shapes)
    row = dict(workload=workload, optimizer=name, params=nparams, note=note)
    if factory is None:
        return row
    try:
        params = make_params(shapes, dtype)
        opt = factory(params)
        ms, lo, hi = time_cuda(opt.step)
        moved = nbytes(shapes)
        row.update(ms=ms, ms_min=lo, ms_max=hi, bytes_per_param=moved / nparams, gbps=moved / (ms / 1e3) / 1e9,
                   of_floor=moved / bw / (ms / 1e3), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        if isinstance(opt, KernelOnly):
            row["host_ms"] = opt.host_ms()
    except Exception as e:  # a row that cannot run here is reported, not fatal
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        params = opt = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return row


# Launch configurations of the kernel-only sweep: fields of flashdist.kernels.triton.LaunchConfig changed
# from DEFAULT. A block is table_groups (large_groups for a per-tensor launch) groups of 32 values; a program
# walks table_blocks (large_blocks) blocks.
def _layout(groups, warps, blocks, **more):
    return dict(table_groups=groups, large_groups=groups, num_warps=warps, table_blocks=blocks, large_blocks=blocks,
                **more)


SWEEP = {
    "default": {},
    "no prefetch": dict(prefetch=False),
    "prefetch 2 blocks ahead": dict(prefetch_ahead=2),
    "prefetch into L1": dict(prefetch_level=1),
    "prefetch into L1, 2 blocks ahead": dict(prefetch_level=1, prefetch_ahead=2),
    "approx at the compiler's registers": dict(approx_max_registers=None),
    "exact at the compiler's registers": dict(exact_max_registers=None),
    "defaults before 2026-12-02 (32 blocks, exact at the compiler's registers)": _layout(
        8, 1, 32, exact_max_registers=None),
    "at most 96 registers": dict(max_registers=96),
    "at most 88 registers": dict(max_registers=88),
    "at most 80 registers": dict(max_registers=80),
    "at most 72 registers": dict(max_registers=72),
    "at most 64 registers": dict(max_registers=64),
    "prefetch into L1, at most 80 registers": dict(prefetch_level=1, max_registers=80),
    "prefetch into L1, at most 72 registers": dict(prefetch_level=1, max_registers=72),
    "16 groups, 1 warp, 16 blocks, at most 72 registers": _layout(16, 1, 16, max_registers=72),
    "8 groups, 1 warp, 2 blocks": _layout(8, 1, 2),
    "8 groups, 1 warp, 4 blocks": _layout(8, 1, 4),
    "8 groups, 1 warp, 12 blocks": _layout(8, 1, 12),
    "8 groups, 1 warp, 16 blocks": _layout(8, 1, 16),
    "8 groups, 1 warp, 24 blocks": _layout(8, 1, 24),
    "8 groups, 1 warp, 32 blocks": _layout(8, 1, 32),
    "8 groups, 1 warp, 64 blocks": _layout(8, 1, 64),
    "4 groups, 1 warp, 64 blocks": _layout(4, 1, 64),
    "16 groups, 1 warp, 16 blocks": _layout(16, 1, 16),
    "16 groups, 2 warps, 8 blocks": _layout(16, 2, 8),
    "32 groups, 4 warps, 8 blocks": _layout(32, 4, 8),
    "32 groups, 4 warps, 8 blocks, no prefetch": _layout(32, 4, 8, prefetch=False),
    "own launch from 2^22 values": dict(large_numel=1 << 22),
    "one table launch for every tensor below 2^30 values": dict(large_numel=1 << 30),
}


# The optimizers a graphed sweep can time, with the bytes their step moves.
SWEEP_OPTIMIZERS = {
    "FlashAdamW": (lambda ps: flashdist.FlashAdamW(ps, lr=LR, capturable=True), flashdist_bytes),
    "FlashSGD": (lambda ps: flashdist.FlashSGD(ps, lr=LR, momentum=0.9, capturable=True), one_moment_bytes),
    "FlashLion": (lambda ps: flashdist.FlashLion(ps, lr=LR, capturable=True), one_moment_bytes),
}


def run_sweep(bw, workloads, configs=tuple(SWEEP), rounds=1, graphed=False, variants=(True, False),
              optimizer="FlashAdamW", pause=0.0):
    """Time the configurations ``configs`` round by round (each round times every configuration once, so that
    a drift of the machine spreads over all of them; ``pause`` seconds of idle GPU before each timing): the
    kernel-only step (FlashAdamW), or with ``graphed`` the class ``optimizer`` through GraphedStep (one
    optimizer per configuration, on the same parameters)."""
    rows = []
    make, nbytes = SWEEP_OPTIMIZERS[optimizer]
    for workload in workloads:
        shapes = WORKLOADS[workload]()
        params = make_params(shapes, torch.bfloat16)
        moved = nbytes(shapes) if graphed else flashdist_bytes(shapes)
        for exact in variants:
            steppers = {}
            for label in configs:
                config = DEFAULT.replace(exact=exact, **SWEEP[label])
                steppers[label] = WithVariant(make(params), exact, True) if graphed else KernelOnly(params, exact)
                steppers[label].config = config
            for r in range(rounds):
                for label, stepper in steppers.items():
                    row = dict(workload=workload, optimizer=optimizer if graphed else "kernel only", exact=exact,
                               config=label, round=r, graphed=graphed, **SWEEP[label])
                    try:
                        time.sleep(pause)
                        ms = time_cuda(stepper.step)[0]
                        row.update(ms=ms, of_floor=moved / bw / (ms / 1e3))
                    except Exception as e:  # a configuration that cannot run here is reported, not fatal
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(rows[-1]), flush=True)
            steppers = None
            gc.collect()
            torch.cuda.empty_cache()
        params = None
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    out = ["| workload | optimizer | params | step ms (median) | B/param | GB/s | of floor | speedup vs flashoptim |",
           "|---|---|---|---|---|---|---|---|"]
    ref = {r["workload"]: r["ms"] for r in rows if r["optimizer"].startswith("flashoptim") and "ms" in r}
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['workload']} | {r['optimizer']} | {r['params'] / 1e6:.0f}M | - | | | | "
                       f"{r.get('error') or r.get('note')} |")
            continue
        speedup = f"{ref[r['workload']] / r['ms']:.2f}x" if r["workload"] in ref else "-"
        extra = f" (host {r['host_ms']:.2f} ms)" if "host_ms" in r else ""
        out.append(f"| {r['workload']} | {r['optimizer']} | {r['params'] / 1e6:.0f}M | {r['ms']:.3f}{extra} | "
                   f"{r['bytes_per_param']:.2f} | {r['gbps']:.0f} | {r['of_floor']:.2f} | {speedup} |")
    return "\n".join(out)


def sweep_table(sweep) -> str:
    """One line per workload, variant and configuration: the median of its rounds' times and their range."""
    out = ["| workload | step | variant | configuration | ms, median of rounds (range) | of floor |",
           "|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["workload"], r["optimizer"], r["exact"], r["config"]) for r in sweep)
    for workload, optimizer, exact, config in keys:
        runs = [r for r in sweep if (r["workload"], r["optimizer"], r["exact"], r["config"]) ==
                (workload, optimizer, exact, config)]
        times = sorted(r["ms"] for r in runs if "ms" in r)
        if times:
            best = max(r["of_floor"] for r in runs if "ms" in r)
            timing = f"{statistics.median(times):.3f} ({times[0]:.3f}-{times[-1]:.3f}) | {best:.2f}"
        else:
            timing = f"- | {runs[0].get('error')}"
        out.append(f"| {workload} | {optimizer} | {'exact' if exact else 'approx'} | {config} | {timing} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON to this path")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel under a few launch configurations")
    ap.add_argument("--sweep-only", action="store_true", help="time only the launch configurations of --sweep")
    ap.add_argument("--configs", nargs="+", choices=list(SWEEP), default=list(SWEEP), metavar="NAME",
                    help="the configurations the sweep times (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="time each configuration of the sweep this many times, "
                    "round by round")
    ap.add_argument("--graphed", action="store_true",
                    help="sweep the FlashAdamW class through GraphedStep instead of the kernel-only step")
    ap.add_argument("--optimizer", choices=list(SWEEP_OPTIMIZERS), default="FlashAdamW",
                    help="the optimizer a --graphed sweep times")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds the GPU idles before each timing of the sweep")
    ap.add_argument("--variants", nargs="+", choices=("exact", "approx"), default=("exact", "approx"),
                    help="the kernel variants the sweep times")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                    help="time only the rows whose optimizer name contains one of these texts")
    args = ap.parse_args()
    if args.rounds < 1 or args.pause < 0:
        ap.error("--rounds must be at least 1 and --pause at least 0")
    if args.optimizer != "FlashAdamW" and not args.graphed:
        ap.error("--optimizer applies to a --graphed sweep (the kernel-only sweep times FlashAdamW's step)")
    if not torch.cuda.is_available():
        sys.exit("bench_step.py needs a CUDA device")
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(json.dumps(info), flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for workload in [] if args.sweep_only else args.workloads:
        shapes = WORKLOADS[workload]()
        for name, (dtype, factory, nbytes, note) in cases().items():
            if args.only and not any(text in name for text in args.only):
                continue
            rows.append(run_case(name, dtype, factory, nbytes, note, workload, shapes, bw))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:  # the main table first: a sweep cut short by a time limit loses only itself
        with open(args.out, "w") as f:
            json.dump(dict(info, copy_bandwidth=bw, rows=rows, sweep=[]), f, indent=1)
    print()
    if rows:
        print(table(rows), flush=True)
    sweep = []
    if args.sweep or args.sweep_only:
        sweep = run_sweep(bw, args.workloads, args.configs, args.rounds, args.graphed,
                          tuple(v == "exact" for v in args.variants), args.optimizer, args.pause)
    if sweep:
        print(sweep_table(sweep), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info, copy_bandwidth=bw, rows=rows, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
