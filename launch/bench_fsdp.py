"""FSDP2 training benchmark: per-rank peak memory, persistent bytes per parameter and step time of a
Llama-shaped model with FlashAdamW (24-bit; and with gradient release), torch.optim.AdamW with fp32 master
weights (fp32 parameters + bf16 compute through MixedPrecisionPolicy) and, when importable, flashoptim.

    torchrun --standalone --nproc_per_node=2 launch/bench_fsdp.py --model 1b --out runs/fsdp.json
    torchrun --standalone --nproc_per_node=2 launch/bench_fsdp.py --model tiny --cpu     # smoke run

Persistent bytes per parameter = parameters + gradients + optimizer state held by rank 0, summed from the
real local tensors right after ``step()`` (flashdist.memory_report), divided by rank 0's parameter count.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama import Llama, LlamaConfig  # noqa: E402

import flashdist  # noqa: E402

CASES = ("adamw_fp32_master", "flash_24bit", "flash_24bit_release", "flashoptim_24bit")


def build(case: str, cfg: LlamaConfig, device: torch.device, cpu: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    compute = torch.float32 if cpu else torch.bfloat16
    if case == "adamw_fp32_master":
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    else:
        model = model.to(torch.bfloat16)
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if case == "adamw_fp32_master":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cpu)
    elif case.startswith("flash_"):
        opt = flashdist.FlashAdamW(model.parameters(), lr=1e-4)
    else:
        import flashoptim

        opt = flashoptim.FlashAdamW(model.parameters(), lr=1e-4, master_weight_bits=24)
    release = flashdist.enable_gradient_release(model, opt) if case.endswith("release") else None
    return model, opt, release


def run_case(case, cfg, args, device, rank):
    model, opt, release = build(case, cfg, device, args.cpu)
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    times, losses, report = [], [], None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup + args.steps):
        if i == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        if report is None:
            report = flashdist.memory_report(opt)  # before the step: gradients held (none under release)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    after_step = flashdist.memory_report(opt)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    n_local = report["numel"]
    persistent = (report["params"] + report["grads"] + after_step["total"] - after_step["params"]
                  - after_step["grads"]) / n_local
    row = {"case": case, "params_total": sum(p.numel() for p in model.parameters()), "params_rank0": n_local,
           "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
           "peak_gib_rank0": peak, "persistent_bytes_per_param": persistent, "memory_report": report,
           "first_loss": losses[0], "last_loss": losses[-1]}
    if release is not None:
        release.remove()
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = LlamaConfig.named(args.model)
    rows = []
    for case in args.cases:
        try:
            row = run_case(case, cfg, args, device, rank)
        except Exception as e:  # a peer that cannot run under FSDP2 is a finding, not a crash
            row = {"case": case, "error": f"{type(e).__name__}: {e}"[:400]}
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "memory_report"}), flush=True)
    if rank == 0:
        base = next((r for r in rows if r["case"] == "adamw_fp32_master" and "error" not in r), None)
        print(f"\n{args.model} Llama shapes, {world} ranks, {device.type}, batch {args.batch} x {args.seq} per rank")
        print("| optimizer | persistent B/param (rank 0) | peak GiB (rank 0) | step ms (median) | vs AdamW |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | - | - | {r['error'][:60]} | |")
                continue
            rel = f"{r['step_ms_median'] / base['step_ms_median']:.2f}x" if base else "-"
            print(f"| {r['case']} | {r['persistent_bytes_per_param']:.2f} | {r['peak_gib_rank0']:.1f} | "
                  f"{r['step_ms_median']:.1f} | {rel} |")
        if args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args)}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
