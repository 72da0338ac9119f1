"""Scaling run (issue #9): Llama-3.1-8B shapes under FSDP2 at any world size, per-rank peak memory, persistent
bytes per parameter and step time for torch.optim.AdamW with fp32 master weights, FlashAdamW (24-bit) and
FlashAdamW with gradient release; and a save-at-N / resume-at-M check of flashdist's resharding DCP
checkpoints at that size.

    # the table, at each world size (1 if it fits, 2, 4, 8)
    torchrun --standalone --nproc_per_node=8 launch/bench/bench_scaling.py --model 8b --out runs/scaling_w8.json
    # resharding at 8B size: save on 8 ranks, resume on 4
    torchrun --standalone --nproc_per_node=8 launch/bench/bench_scaling.py --model 8b --resume-check /tmp/ck --phase save
    torchrun --standalone --nproc_per_node=4 launch/bench/bench_scaling.py --model 8b --resume-check /tmp/ck --phase resume
    # tensor parallelism: TP=2 against FSDP2 on 2 GPUs (docs/benchmarks.md)
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_scaling.py --model 8b --tp 2 --out runs/scaling_tp2.json
    # CPU smoke run (gloo)
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_scaling.py --model tiny --cpu --seq 64

Every case builds a fresh model (random init, ``launch/llama.py``), checkpoints the activations of each
decoder layer (``checkpoint_wrapper``, non-reentrant, applied before ``fully_shard``), shards each layer
and the root with FSDP2, computes in bf16 (``MixedPrecisionPolicy``; fp32 on the CPU) and reduces in fp32.
The measurement loop is ``launch/bench_fsdp.run_case`` (same definitions as the 1B table): peak = the
rank's ``torch.cuda.max_memory_allocated`` after a reset at the end of warm-up; persistent bytes/param =
parameters + gradients + optimizer state of rank 0 from ``flashdist.memory_report``; step = forward +
backward + ``step()`` + ``zero_grad``, median wall time. Memory is freed between cases, and the bytes still
allocated when a case starts are recorded (``allocated_before_gib``).

``--resume-check DIR``: phase ``save`` trains ``--resume-steps`` steps with FlashAdamW at this world size,
then writes DIR/ckpt with ``flashdist.checkpoint.save`` and DIR/saved.json with an exact, sharding-independent
checksum of every fp32 master weight (bf16 parameter + rho) and the loss on a fixed batch. Phase ``resume``
(another world size) loads DIR/ckpt, recomputes both, fails unless every master-weight checksum matches,
then trains ``--resume-steps`` more steps and prints the losses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flashdist
from flashdist import distributed as D

if __package__:  # python -m launch.bench.bench_scaling
    from . import bench_fsdp
    from ..benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, run_or_record, write_json
    from ..llama import LlamaConfig
else:  # run as a file (python or torchrun launch/bench/bench_scaling.py): its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    import bench_fsdp
    from benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, run_or_record, write_json
    from llama import LlamaConfig

CASES = ("adamw_fp32_master", "flash_24bit", "flash_24bit_release")
LABELS = {"adamw_fp32_master": "torch.optim.AdamW, fp32 master weights", "flash_24bit": "FlashAdamW 24-bit",
          "flash_24bit_release": "FlashAdamW 24-bit + gradient release",
          "flashoptim_24bit": "flashoptim FlashAdamW 24-bit",
          "muon_fp32_master": "torch.optim.Muon + AdamW, fp32 master weights", "flash_muon_24bit": "FlashMuon 24-bit"}
PAPER = "paper (FlashOptim, Llama-3.1-8B finetuning): peak 175 GiB with AdamW -> 113 GiB with FlashOptim"


# ----- model ---------------------------------------------------------------------------------------------

def build(case: str, cfg: LlamaConfig, device: torch.device, cpu: bool, *, activation_checkpointing: bool = True,
          state_dict_format: str = "portable"):
    """``bench_fsdp.build``, with activation checkpointing per decoder layer unless told otherwise."""
    return bench_fsdp.build(case, cfg, device, cpu, activation_checkpointing=activation_checkpointing,
                            state_dict_format=state_dict_format)


# ----- the table -----------------------------------------------------------------------------------------

def run_cases(args, cfg, device, rank: int, world: int) -> list[dict]:
    rows = []
    for case in args.cases:
        free_memory(device)
        before = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        t0 = time.perf_counter()
        args.activation_checkpointing = not args.no_ac  # read by bench_fsdp.run_case's build
        # (an out-of-memory case, AdamW at 1 rank, is an error row)
        row = run_or_record(case, lambda: bench_fsdp.run_case(case, cfg, args, device, rank), device)
        free_memory(device)
        row["world"] = world
        row["allocated_before_gib"] = before
        row["case_s"] = time.perf_counter() - t0
        if "error" not in row:
            row["peak_gib_max"] = max(row["peak_gib_per_rank"])  # run_case gathers every rank's peak
            row["tokens_per_s_per_rank"] = args.batch * args.seq / (row["step_ms_median"] / 1e3)
        rows.append(row)
        if rank == 0:
            print(json.dumps({k: v for k, v in row.items() if k != "memory_report"}), flush=True)
    return rows


def print_table(rows: list[dict], args, world: int, device: torch.device, n_params: int | None) -> None:
    base = next((r for r in rows if r["case"] == "adamw_fp32_master" and "error" not in r), None)
    size = f"{n_params / 1e9:.2f} B parameters" if n_params else ""
    ac = "no activation checkpointing" if args.no_ac else "activation checkpointing per layer"
    tp = getattr(args, "tp", 1)
    layout = f"TP {tp} x FSDP2 {world // tp}" if tp > 1 else "FSDP2"
    per = "per TP group" if tp > 1 else "per rank"
    print(f"\n{args.model} Llama shapes ({size}), {layout} on {world} rank(s), {device.type}, batch {args.batch} x "
          f"{args.seq} tokens {per}, {ac}, {args.warmup} warm-up + {args.steps} timed steps")
    print("| optimizer | ranks | persistent B/param | persistent GiB/rank | peak GiB/rank (max over ranks) | "
          "step ms (median) | tokens/s/rank | vs AdamW |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        label = LABELS.get(r["case"], r["case"])
        if "error" in r:
            print(f"| {label} | {world} | - | - | - | {r['error'][:80]} | - | - |")
            continue
        rel = f"{r['step_ms_median'] / base['step_ms_median']:.2f}x" if base else "-"
        gib = r["persistent_bytes_per_param"] * r["params_rank0"] / 2**30
        print(f"| {label} | {world} | {r['persistent_bytes_per_param']:.2f} | {gib:.1f} | {r['peak_gib_max']:.1f} | "
              f"{r['step_ms_median']:.0f} | {r['tokens_per_s_per_rank']:.0f} | {rel} |")
    print(PAPER, flush=True)


# ----- resume check --------------------------------------------------------------------------------------

_CHUNK = 1 << 24


def _row_offset(p: torch.Tensor) -> int:
    """First global row of this rank's local shard (DTensor Shard(0) splits rows like torch.chunk)."""
    if not D.is_dtensor(p):
        return 0
    offset, rows = 0, p.shape[0]
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_shard():
            n = p.device_mesh.size(mesh_dim)
            size = -(-rows // n)
            offset += min(coordinate[mesh_dim] * size, rows)
            rows = max(0, min(size, rows - coordinate[mesh_dim] * size))
    return offset


@torch.no_grad()
def master_checksums(model, opt) -> dict[str, list[int]]:
    """Per parameter, two int64 sums over every element of its fp32 master weight: the low and the high 16
    bits of the float's bit pattern, each times a weight from the element's global position (so moved
    elements change it). Exact integer sums, so equal on any world size exactly when the weights are."""
    names, sums = [], []
    for name, p in model.named_parameters():
        master = D.local(opt.master_weight(p)).float().reshape(-1)
        start = _row_offset(p) * (p.shape[1:].numel() if p.ndim else 1)
        lo = torch.zeros((), dtype=torch.int64, device=master.device)
        hi = torch.zeros((), dtype=torch.int64, device=master.device)
        for i in range(0, master.numel(), _CHUNK):
            bits = master[i:i + _CHUNK].view(torch.int32).to(torch.int64)
            w = (torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) + (start + i)) % 65521 + 1
            lo += ((bits & 0xFFFF) * w).sum()
            hi += ((bits >> 16) * w).sum()
        names.append(name)
        sums.append(torch.stack([lo, hi]))
    total = torch.stack(sums)
    dist.all_reduce(total)
    return {name: [int(a), int(b)] for name, (a, b) in zip(names, total.tolist())}


def _batch(cfg, args, seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)


def _train(model, opt, cfg, args, device, rank: int, first: int, n: int) -> list[float]:
    losses = []
    for step in range(first, first + n):
        x = _batch(cfg, args, 1000 * (step + 1) + rank, device)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def _eval_loss(model, cfg, args, device) -> float:
    x = _batch(cfg, args, 7, device)  # the same batch on every rank and every world size
    return model(x[:, :-1], x[:, 1:]).item()


def resume_check(args, cfg, device, rank: int, world: int) -> dict:
    root = Path(args.resume_check)
    ckpt, saved_json = root / "ckpt", root / "saved.json"
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, opt, _ = build("flash_24bit", cfg, device, args.cpu, activation_checkpointing=not args.no_ac,
                          state_dict_format=args.ckpt_format)
    out: dict = {"phase": args.phase, "world": world, "ckpt": str(ckpt), "format": args.ckpt_format,
                 "build_s": time.perf_counter() - t0}
    if args.phase == "save":
        out["losses"] = _train(model, opt, cfg, args, device, rank, 0, args.resume_steps)
        out["steps"] = args.resume_steps
        out["checksums"] = master_checksums(model, opt)
        out["eval_loss"] = _eval_loss(model, cfg, args, device)
        t0 = time.perf_counter()
        flashdist.checkpoint.save(ckpt, model, opt, extra={"steps": args.resume_steps, "world": world})
        out["save_s"] = time.perf_counter() - t0
        out["ckpt_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if rank == 0 else None
        if rank == 0:
            saved_json.write_text(json.dumps(out))
            print(f"saved at {world} rank(s): {ckpt} ({out['ckpt_bytes'] / 2**30:.2f} GiB, {args.ckpt_format}, "
                  f"{out['save_s']:.1f} s) after {args.resume_steps} steps, losses "
                  f"{[round(v, 4) for v in out['losses']]}, eval loss {out['eval_loss']:.6f}", flush=True)
    else:
        saved = json.loads(saved_json.read_text())
        t0 = time.perf_counter()
        extra = flashdist.checkpoint.load(ckpt, model, opt)
        out["load_s"] = time.perf_counter() - t0
        out["saved_world"] = int(extra["world"])
        sums = master_checksums(model, opt)
        differ = sorted(k for k in set(sums) | set(saved["checksums"]) if sums.get(k) != saved["checksums"].get(k))
        out["master_tensors"] = len(sums)
        out["master_tensors_differing"] = differ
        out["eval_loss_saved"] = saved["eval_loss"]
        out["eval_loss"] = _eval_loss(model, cfg, args, device)
        first = int(extra["steps"])
        out["losses"] = _train(model, opt, cfg, args, device, rank, first, args.resume_steps)
        if rank == 0:
            print(f"resumed at {world} rank(s) from a checkpoint saved at {out['saved_world']} ({out['load_s']:.1f} s "
                  f"load): fp32 master weights {len(sums) - len(differ)} of {len(sums)} tensors equal the saved "
                  f"ones; eval loss {out['eval_loss']:.6f} (saved {saved['eval_loss']:.6f}); losses of steps "
                  f"{first + 1}-{first + args.resume_steps}: {[round(v, 4) for v in out['losses']]}", flush=True)
    if device.type == "cuda":
        out["peak_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    free_memory(device)
    return out


# ----- main ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b", choices=["8b", "1b", "tiny"])
    ap.add_argument("--cases", nargs="*", default=None, choices=bench_fsdp.CASES,
                    help=f"default: {' '.join(CASES)} (none with --resume-check unless named)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke runs)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree of the table's cases (bench_fsdp --tp): TP inside groups of TP "
                         "consecutive ranks, FSDP2 across them; --batch is then per TP group")
    ap.add_argument("--out", default=None, help="JSON file for the rows (and the resume check)")
    ap.add_argument("--resume-check", metavar="DIR", default=None,
                    help="save (--phase save) or load and check (--phase resume) a FlashAdamW checkpoint in DIR")
    ap.add_argument("--phase", choices=["save", "resume"], default=None)
    ap.add_argument("--resume-steps", type=int, default=2, help="steps before the save and after the resume")
    ap.add_argument("--ckpt-format", choices=["compressed", "portable"], default="compressed",
                    help="FlashAdamW state_dict_format of the checkpoint (compressed: 8-bit moments, 3.1 B/param)")
    args = ap.parse_args(argv)
    if (args.resume_check is None) != (args.phase is None):
        ap.error("--resume-check DIR and --phase save|resume go together")
    if args.tp < 1:
        ap.error(f"--tp must be a positive integer, got {args.tp}")
    if args.tp > 1 and args.resume_check:
        ap.error("--resume-check checksums row shards (FSDP2 only): run it without --tp")
    if args.cases is None:
        args.cases = [] if args.resume_check else list(CASES)
    return args


def run(args) -> dict:
    """Everything after the process group is up (torchrun, or tests/distributed/harness.run_ranks)."""
    rank, world, device = rank_and_device()
    cfg = LlamaConfig.named(args.model)
    result: dict = {"meta": run_meta(args, world, device, config=vars(cfg)), "rows": []}
    if args.cases:
        rows = run_cases(args, cfg, device, rank, world)
        result["rows"] = rows
        if rank == 0:
            n = next((r["params_total"] for r in rows if "params_total" in r), None)
            print_table(rows, args, world, device, n)
            write_json(args.out, result)  # before the resume check, which may be cut short
    if args.resume_check:
        result["resume_check"] = resume_check(args, cfg, device, rank, world)
        if rank == 0:
            write_json(args.out, result)
    return result


def main(argv=None) -> None:
    result = in_process_group(run, parse_args(argv))
    check = result.get("resume_check", {})
    if check.get("master_tensors_differing"):
        sys.exit(f"resume check failed: master weights differ from the saved ones: {check['master_tensors_differing'][:8]}")


if __name__ == "__main__":
    main()
    exit_now()  # gloo's worker threads and the interpreter's shutdown: benchlib.exit_now
