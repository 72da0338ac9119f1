"""Optimizer offload benchmark: host memory, GPU peak and step time of a Llama-shaped model (launch/llama.py)
whose optimizer state lives in host memory and steps on the CPU, one case per process.

    # one H200, Llama-3.1-8B shapes: run each case in its own process (a case that outgrows host memory is
    # killed by the kernel, and peaks must not carry over)
    for case in ds_cpu_adam ds_flash fsdp2_adamw fsdp2_flash; do
        torchrun --standalone --nproc_per_node=1 launch/bench/bench_offload.py --model 8b --cases $case \
            --out runs/offload/$case.json
    done
    torchrun --standalone --nproc_per_node=1 launch/bench/bench_offload.py --model tiny --cpu   # smoke run, no GPU

Cases (bf16 compute, ``--batch`` x ``--seq`` tokens per rank):

- ``ds_cpu_adam``: DeepSpeed ZeRO-``--stage`` with ``"offload_optimizer": {"device": "cpu"}`` and DeepSpeed's
  "AdamW", which ZeRO-Offload runs as DeepSpeedCPUAdam (a C++ op DeepSpeed JIT-builds on first use: g++ and
  ninja). Host: fp32 master partitions and moments (4 + 8 bytes per parameter), fp32 gradient partitions.
- ``ds_flash``: the same with ``"type": "FlashAdamW"``: fp32 master partitions (4) and 8-bit moments (2.125),
  stepped by flashdist's fused CPU step.
- ``fsdp2_adamw``: FSDP2 ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` with fp32 parameters, bf16
  compute (``MixedPrecisionPolicy``) and torch.optim.AdamW on the host shards: 4 + 4 (fp32 gradient) + 8.
- ``fsdp2_flash``: FSDP2 with ``CPUOffloadPolicy()``, bf16 parameters and FlashAdamW: 2 + 1 (rho) + 2 (bf16
  gradient) + 2.125.

Columns: "host opt B/param" is measured, the bytes of the optimizer's own tensors in host memory (master
partitions or parameter shards, rho, moments) over the parameters they cover; "host RSS GiB" is the
process's resident set after the timed steps (VmRSS: model copies, gradients, pinned buffers, everything)
and "host peak GiB" its high-water mark (VmHWM); "GPU peak GiB" is torch.cuda.max_memory_allocated over the
timed steps. Llama-3.1-8B's full-precision baselines need more host memory than a one-GPU machine may
have (fp32 masters, moments and gradients: about 16 bytes per parameter, 128 GB); ``--layers`` keeps the
8B widths with fewer layers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

import flashdist
from flashdist import distributed as D

if __package__:  # python -m launch.bench.bench_offload
    from ..benchlib import exit_now, run_or_record, timed_steps
    from ..llama import Llama, LlamaConfig
else:  # run as a file (python or torchrun launch/bench/bench_offload.py): its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    from benchlib import exit_now, run_or_record, timed_steps
    from llama import Llama, LlamaConfig

CASES = ("ds_cpu_adam", "ds_flash", "fsdp2_adamw", "fsdp2_flash")
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def host_gib() -> tuple[float, float]:
    """(resident set, its high-water mark) of this process in GiB, from /proc/self/status."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024 / 2**30
    return values.get("VmRSS", float("nan")), values.get("VmHWM", float("nan"))


def host_optimizer_bytes(tensors_and_state) -> tuple[float, int]:
    """(bytes of host-resident weights and state tensors / element count of the weights, that count)."""
    held = numel = 0
    for weight, state in tensors_and_state:
        local = D.local(weight)
        if local.device.type != "cpu":
            continue
        numel += local.numel()
        held += local.numel() * local.element_size()
        for value in state.values():
            value = D.local(value) if torch.is_tensor(value) else value
            if torch.is_tensor(value) and value.dim() > 0 and value.device.type == "cpu":
                held += value.numel() * value.element_size()
    return held / max(numel, 1), numel


def deepspeed_case(case: str, cfg: LlamaConfig, args, device: torch.device):
    from flashdist.integrations import deepspeed as fds

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": args.stage,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": device.type == "cuda"}}}
    params = dict(HYPER, betas=list(HYPER["betas"]))
    if case == "ds_cpu_adam":
        config["optimizer"] = {"type": "AdamW", "params": params}
    else:
        config["optimizer"] = {"type": "FlashAdamW", "params": params}
        config["zero_force_ds_cpu_optimizer"] = False
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    engine, *_ = fds.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    def optimizer_tensors():
        basic = engine.basic_optimizer
        return [(m, basic.state.get(m, {})) for m in fds.master_partitions(engine)]

    name = type(engine.basic_optimizer).__name__
    return step, optimizer_tensors, name, (lambda: engine.destroy())


def fsdp2_case(case: str, cfg: LlamaConfig, args, device: torch.device):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if case == "fsdp2_adamw":  # fp32 master parameters on the host, bf16 compute on the GPU
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
    else:  # bf16 parameters + rho: FlashAdamW keeps 24-bit master weights itself
        model.to(torch.bfloat16)
        mp = MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    if case == "fsdp2_adamw":
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
    else:
        opt = flashdist.FlashAdamW(model.parameters(), **HYPER)

    def step(x):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def optimizer_tensors():
        return [(p, opt.state.get(p, {})) for p in model.parameters()]

    return step, optimizer_tensors, type(opt).__name__, (lambda: None)


def run_case(case: str, cfg: LlamaConfig, args, device: torch.device) -> dict:
    import torch.distributed as dist

    build = deepspeed_case if case.startswith("ds_") else fsdp2_case
    step, optimizer_tensors, name, destroy = build(case, cfg, args, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    timing = timed_steps(lambda: step(x), args.warmup, args.steps, device)
    per_param, numel = host_optimizer_bytes(optimizer_tensors())
    rss, hwm = host_gib()
    row = {"case": case, "optimizer": name, "world": world, "host_numel_rank0": numel,
           "host_optimizer_bytes_per_param": per_param, "host_rss_gib": rss, "host_peak_gib": hwm,
           "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
           **timing, "tokens_per_s": world * args.batch * args.seq / (timing["step_ms_median"] / 1e3)}
    destroy()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count (same widths)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage of the DeepSpeed cases")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="no GPU: gloo, smoke runs (DeepSpeedCPUAdam is skipped)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    cases = list(args.cases)
    if any(c.startswith("ds_") for c in cases) and not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
        from collections import defaultdict

        import deepspeed.ops

        # DeepSpeed's C++ CPU ops are compiled on first use (minutes): off on CPU; DeepSpeedCPUAdam is one of them
        deepspeed.ops.__compatible_ops__ = defaultdict(bool)
        cases = [c for c in cases if c != "ds_cpu_adam"]
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if any(c.startswith("ds_") for c in cases):
        import deepspeed

        deepspeed.init_distributed()
    else:
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = LlamaConfig.named(args.model)
    if args.layers is not None:
        cfg = replace(cfg, layers=args.layers)
    rows = []
    for case in cases:
        row = run_or_record(case, lambda: run_case(case, cfg, args, device), device)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print(f"\n{args.model} Llama shapes ({cfg.layers} layers), {dist.get_world_size()} rank(s), {device.type}, "
              f"batch {args.batch} x {args.seq} per rank, optimizer offloaded to the host")
        print("| case | optimizer | host opt B/param | host RSS GiB | host peak GiB | GPU peak GiB | step ms |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | - | - | - | - | - | {r['error'][:60]} |")
                continue
            print(f"| {r['case']} | {r['optimizer']} | {r['host_optimizer_bytes_per_param']:.3f} | "
                  f"{r['host_rss_gib']:.1f} | {r['host_peak_gib']:.1f} | {r['gpu_peak_gib']:.1f} | "
                  f"{r['step_ms_median']:.0f} |")
        if args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args)}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo's worker threads and the interpreter's shutdown: benchlib.exit_now
