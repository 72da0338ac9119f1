"""Train the byte-level GPT of launch/train.py with DeepSpeed ZeRO and a flashdist optimizer named in the
DeepSpeed config (launch/configs/*.json: "optimizer": {"type": "FlashAdamW", ...}).

    torchrun --nproc_per_node=2 launch/train_deepspeed.py --config launch/configs/zero2.json \\
        --steps 200 --ckpt-dir runs/ds/ckpt --ckpt-every 100
    torchrun --nproc_per_node=2 launch/train_deepspeed.py --config launch/configs/zero2.json \\
        --steps 300 --ckpt-dir runs/ds/ckpt --resume                      # same world size: exact
    python launch/train_deepspeed.py --to-universal runs/ds/ckpt           # then any world size / stage:
    torchrun --nproc_per_node=3 launch/train_deepspeed.py --config launch/configs/zero3.json \\
        --steps 300 --ckpt-dir runs/ds/ckpt --resume --universal
    python launch/train_deepspeed.py --export-fp32 runs/ds/ckpt --out model.safetensors

The `deepspeed` launcher works as well (``deepspeed --num_gpus 2 launch/train_deepspeed.py ...``). On a
machine without CUDA, DeepSpeed runs on the CPU (DS_ACCELERATOR=cpu, set here) with gloo. The LR schedule
is the config's ``scheduler`` section; its ``total_num_steps`` is set to ``--steps``. Writes ``log.jsonl``
and ``summary.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from flashdist.integrations import deepspeed as fds

if __package__:  # python -m launch.train_deepspeed
    from .data import VOCAB, batch, load_corpus
    from .model import GPT, GPTConfig
else:  # run as a file (python or torchrun launch/train_deepspeed.py): its own folder is on sys.path
    from data import VOCAB, batch, load_corpus
    from model import GPT, GPTConfig

CONFIGS = Path(__file__).resolve().parent / "configs"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIGS / "zero2.json"), help="DeepSpeed JSON config")
    ap.add_argument("--steps", type=int, default=200, help="length of the run (the LR schedule's horizon)")
    ap.add_argument("--stop-at", type=int, default=None, help="stop early at this step (resume later)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per rank per step (default: the config's train_micro_batch_size_per_gpu)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--weight-decay", type=float, default=None,
                    help="weight decay of matrices (default: the config's); vectors get none")
    ap.add_argument("--corpus-mb", type=float, default=None, help="cap the training bytes (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--ckpt-dir", default=None, help="engine.save_checkpoint folder")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    ap.add_argument("--universal", action="store_true",
                    help="with --resume: load the universal checkpoint (any world size or ZeRO stage)")
    ap.add_argument("--out-dir", default="runs/deepspeed")
    ap.add_argument("--to-universal", metavar="CKPT_DIR", default=None,
                    help="no training: convert CKPT_DIR's latest checkpoint to a universal one, keeping rho")
    ap.add_argument("--export-fp32", metavar="CKPT_DIR", default=None,
                    help="no training: write CKPT_DIR's latest checkpoint as fp32 weights (param + rho) to --out")
    ap.add_argument("--out", default="model.safetensors", help="output file of --export-fp32")
    args = ap.parse_args(argv)
    if (args.resume or args.ckpt_every) and not args.ckpt_dir:
        ap.error("--resume and --ckpt-every need --ckpt-dir")
    if args.universal and not args.resume:
        ap.error("--universal is a way to --resume")
    return args


def _cpu_deepspeed() -> None:
    """DeepSpeed on a machine without CUDA: the CPU accelerator, without DeepSpeed's C++ extensions (its
    shared-memory all-reduce is compiled on first use, minutes on a small machine; gloo does the job)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from collections import defaultdict

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = defaultdict(bool)


def _offline(args) -> None:
    if args.to_universal:
        print("universal checkpoint:", fds.to_universal(args.to_universal))
        return
    weights = fds.fp32_state_dict_from_zero_checkpoint(args.export_fp32)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, args.out)
    print(f"{len(weights)} fp32 tensors, {sum(v.numel() for v in weights.values())} values -> {args.out}")


def _config(args) -> dict:
    config = fds.load_config(args.config)
    scheduler = config.get("scheduler") or {}
    if "total_num_steps" in scheduler.get("params", {}):
        scheduler["params"]["total_num_steps"] = args.steps
    if args.universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config.pop("train_batch_size", None)
    return config


def _param_groups(model, weight_decay: float | None) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "pos"]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or n == "pos"]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    return groups


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        _cpu_deepspeed()
    if args.to_universal or args.export_fp32:
        return _offline(args)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    train, val, corpus = load_corpus(int(args.corpus_mb * 2**20) if args.corpus_mb else None)
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab=VOCAB, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer,
                          n_head=args.n_head))
    engine, _, _, scheduler = fds.initialize(model=model, model_parameters=_param_groups(model, args.weight_decay),
                                             config=_config(args))
    micro = engine.train_micro_batch_size_per_gpu()
    out = Path(args.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    start = 0
    if args.resume:
        _, client = fds.load_checkpoint(engine, args.ckpt_dir)
        start = int((client or {}).get("step", engine.global_steps))
    stop = min(args.steps, args.stop_at or args.steps)
    log = []

    def mean(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / world

    if rank == 0:
        print(f"{type(engine.basic_optimizer).__name__} under ZeRO-{engine.zero_optimization_stage()}, {world} "
              f"ranks, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, steps {start} -> {stop}",
              flush=True)
    t0 = time.perf_counter()
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1_000_003 * args.seed + 1009 * step + rank)
        x, y = batch(train, micro, args.seq_len, g)
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        if (step + 1) % args.log_every == 0 or step + 1 == stop:
            record = {"step": step + 1, "loss": mean(loss.item()), "lr": engine.get_lr()[0],
                      "ms_per_step": 1e3 * (time.perf_counter() - t0) / (step + 1 - start)}
            log.append(record)
            if rank == 0:
                print(json.dumps(record), flush=True)
        if args.ckpt_dir and ((args.ckpt_every and (step + 1) % args.ckpt_every == 0) or step + 1 == stop):
            engine.save_checkpoint(args.ckpt_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
    engine.eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(10_000 + rank)
        val_loss = mean(sum(engine(*(t.to(device) for t in batch(val, micro, args.seq_len, g))).item()
                            for _ in range(args.eval_batches)) / args.eval_batches)
    summary = {"optimizer": type(engine.basic_optimizer).__name__, "zero_stage": engine.zero_optimization_stage(),
               "world": world, "start": start, "stop": stop, "final_loss": log[-1]["loss"] if log else None,
               "val_loss": val_loss, "config": args.config, "corpus": corpus,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    if rank == 0:
        print(json.dumps({k: summary[k] for k in ("final_loss", "val_loss")}), flush=True)
        with open(out / "log.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    engine.destroy()
    dist.barrier()
    return summary


if __name__ == "__main__":
    main()
