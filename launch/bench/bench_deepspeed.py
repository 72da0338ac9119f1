"""DeepSpeed ZeRO benchmark: per-rank peak memory, optimizer bytes per parameter and step time of a
Llama-shaped model (launch/llama.py) with DeepSpeed's own Adam against flashdist's FlashAdamW named in the
DeepSpeed config, in one run.

    torchrun --standalone --nproc_per_node=2 launch/bench/bench_deepspeed.py --model 1b --out runs/deepspeed.json
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_deepspeed.py --model tiny --cpu   # smoke run

Cases (ZeRO stage ``--stage``, bf16 model, ``--batch`` x ``--seq`` tokens per rank):

- ``ds_adamw``: DeepSpeed's "AdamW" (FusedAdam on CUDA, JIT-built by DeepSpeed on first use, which needs nvcc
  and ninja; torch.optim.AdamW with ``--cpu``, ``--torch-adam`` or when FusedAdam cannot be built), fp32 master
  partitions and fp32 moments: 4 + 8 bytes per parameter in the optimizer. DeepSpeed 0.19.8's builder cannot
  parse arch-specific entries of TORCH_CUDA_ARCH_LIST (``9.0a``: ``invalid literal for int() ... '0a'``), so
  the script drops such suffixes before DeepSpeed builds (``fused_adam_arch_list``).
- ``ds_adamw_bf16_states``: the same with DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states
  (bf16 masters and moments: 2 + 4; 16-bit master weights).
- ``flash_fp32_masters``: FlashAdamW on DeepSpeed's fp32 master partitions: 4 + 2.125.
- ``flash_bf16_masters``: FlashAdamW with bf16 master partitions + rho (24-bit masters): 2 + 1 + 2.125.

"optimizer B/param" is measured: the bytes of rank 0's master partitions and optimizer state tensors over
the partitions' element count. Peak memory is torch.cuda.max_memory_allocated after the warm-up steps. Cases
run one after another in one process can carry memory over (seen on two H200s: 29.7 GiB for
``ds_adamw_bf16_states`` after ``ds_adamw`` with FusedAdam, 18.6 GiB alone), so for peaks run one case per
process (``--cases ds_adamw``, ...).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import re
from pathlib import Path

import torch

from flashdist.integrations import deepspeed as fds

if __package__:  # python -m launch.bench.bench_deepspeed
    from ..benchlib import run_or_record, timed_steps
    from ..llama import Llama, LlamaConfig
else:  # run as a file (python or torchrun launch/bench/bench_deepspeed.py): its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    from benchlib import run_or_record, timed_steps
    from llama import Llama, LlamaConfig

CASES = ("ds_adamw", "ds_adamw_bf16_states", "flash_fp32_masters", "flash_bf16_masters")


def fused_adam_arch_list(arch: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST in the form DeepSpeed's JIT op builder can parse, or None to leave it as it is.

    DeepSpeed 0.19.8 (op_builder/builder.py, compute_capability_args) sorts the list by
    ``int(part.split('+')[0])`` over ``cc.split('.')``, so an arch-specific entry that torch accepts, such as
    ``9.0a`` or ``10.0f``, fails with ``ValueError: invalid literal for int() with base 10: '0a'`` before
    nvcc runs. FusedAdam needs no arch-specific instructions: drop the suffix, keep ``+PTX``."""
    if not arch or not re.search(r"\d[a-z]", arch):
        return None
    entries = [re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", cc.strip()) for cc in re.split(r"[;\s]+", arch) if cc.strip()]
    return ";".join(dict.fromkeys(entries))


def config_for(case: str, args, torch_adam: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": args.stage}}
    params = {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}
    if case.startswith("ds_"):
        config["optimizer"] = {"type": "AdamW", "params": dict(params, torch_adam=torch_adam)}
    else:
        config["optimizer"] = {"type": "FlashAdamW", "params": params}
    if case.endswith("bf16_states") or case.endswith("bf16_masters"):
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return config


def optimizer_bytes_per_param(engine) -> tuple[float, int]:
    """(bytes of master partitions + optimizer state tensors on this rank / partition numel, that numel)."""
    masters = fds.master_partitions(engine)
    state = engine.basic_optimizer.state
    held = numel = 0
    for m in masters:
        numel += m.numel()
        held += m.numel() * m.element_size()
        for value in state.get(m, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                held += value.numel() * value.element_size()
    return held / max(numel, 1), numel


def run_case(case: str, cfg: LlamaConfig, args, device: torch.device, rank: int) -> dict:
    import torch.distributed as dist

    torch_adam = args.cpu or args.torch_adam

    def build():
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(cfg)
        engine, *_ = fds.initialize(model=model, model_parameters=model.parameters(),
                                    config=config_for(case, args, torch_adam))
        return model, engine

    try:
        model, engine = build()
    except Exception as e:  # FusedAdam is compiled on first use; without a CUDA toolchain use torch's AdamW
        if not case.startswith("ds_") or torch_adam:
            raise
        if rank == 0:
            print(f"{case}: DeepSpeed's FusedAdam is not available ({type(e).__name__}: {str(e)[:200]}); "
                  "using torch.optim.AdamW", flush=True)
        gc.collect()
        torch_adam = True
        model, engine = build()
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)

    def step(engine=engine):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    timing = timed_steps(step, args.warmup, args.steps, device)
    per_param, numel = optimizer_bytes_per_param(engine)
    world = dist.get_world_size()
    row = {"case": case, "optimizer": type(engine.basic_optimizer).__name__ + (" (torch)" if torch_adam and
                                                                              case.startswith("ds_") else ""),
           "zero_stage": args.stage, "params_total": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                                         for p in model.parameters()),
           "partition_numel_rank0": numel, "optimizer_bytes_per_param": per_param,
           "peak_gib_rank0": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
           **timing, "tokens_per_s": world * args.batch * args.seq / (timing["step_ms_median"] / 1e3)}
    engine.destroy()
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch-adam", action="store_true", help="DeepSpeed cases: torch.optim.AdamW, not FusedAdam")
    ap.add_argument("--cpu", action="store_true", help="DeepSpeed on the CPU with gloo (smoke runs)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
        from collections import defaultdict

        import deepspeed.ops

        # DeepSpeed's C++ CPU extensions are compiled on first use (minutes); gloo and torch's AdamW suffice.
        deepspeed.ops.__compatible_ops__ = defaultdict(bool)
    import deepspeed
    import torch.distributed as dist

    if cuda and not args.torch_adam:
        fixed = fused_adam_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if fixed is not None:
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']!r} -> {fixed!r} for DeepSpeed's "
                      "FusedAdam JIT build (its parser rejects arch suffixes)", flush=True)
            os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = LlamaConfig.named(args.model)
    rows = []
    for case in args.cases:
        row = run_or_record(case, lambda: run_case(case, cfg, args, device, rank), device)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        base = next((r for r in rows if r["case"] == "ds_adamw" and "error" not in r), None)
        print(f"\n{args.model} Llama shapes, ZeRO-{args.stage}, {world} ranks, {device.type}, "
              f"batch {args.batch} x {args.seq} per rank, DeepSpeed {deepspeed.__version__}")
        print("| case | optimizer | optimizer B/param (rank 0) | peak GiB (rank 0) | step ms (median) | vs ds_adamw |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | - | - | - | {r['error'][:60]} | |")
                continue
            rel = f"{r['step_ms_median'] / base['step_ms_median']:.2f}x" if base else "-"
            print(f"| {r['case']} | {r['optimizer']} | {r['optimizer_bytes_per_param']:.3f} | "
                  f"{r['peak_gib_rank0']:.1f} | {r['step_ms_median']:.1f} | {rel} |")
        if args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "world": world,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args)}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
