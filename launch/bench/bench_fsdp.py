"""FSDP2 training benchmark: per-rank peak memory, persistent bytes per parameter and step time of a
Llama-shaped model with FlashAdamW (24-bit; and with gradient release, which steps complete FSDP groups in
batched optimizer calls of about 64 MiB of gradient shards, right after their reduce-scatters),
torch.optim.AdamW with fp32 master weights (fp32 parameters + bf16 compute through MixedPrecisionPolicy)
and, when importable, flashoptim.

    torchrun --standalone --nproc_per_node=2 launch/bench/bench_fsdp.py --model 1b --out runs/fsdp.json
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_fsdp.py --model tiny --cpu     # smoke run

Persistent bytes per parameter = parameters + gradients + optimizer state held by rank 0, summed from the
real local tensors right after ``step()`` (flashdist.memory_report), divided by rank 0's parameter count.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flashdist

if __package__:  # python -m launch.bench.bench_fsdp
    from ..benchlib import MuonWithAdamW, exit_now, run_or_record
    from ..llama import Llama, LlamaConfig, tensor_parallel
else:  # run as a file (python or torchrun launch/bench/bench_fsdp.py): its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    from benchlib import MuonWithAdamW, exit_now, run_or_record
    from llama import Llama, LlamaConfig, tensor_parallel

CASES = ("adamw_fp32_master", "flash_24bit", "flash_24bit_release", "flashoptim_24bit")
# Muon (on request: --cases): torch.optim.Muon (+ AdamW on the embedding, head and norms) with fp32 parameters on one
# rank, and FlashMuon; both split the model with flashdist.muon_param_groups and use adjust_lr_fn="match_rms_adamw"
MUON_CASES = ("muon_fp32_master", "flash_muon_24bit")
ALL_CASES = CASES + MUON_CASES
FP32_CASES = ("adamw_fp32_master", "muon_fp32_master")


def build(case: str, cfg: LlamaConfig, device: torch.device, cpu: bool, *, activation_checkpointing: bool = False,
          state_dict_format: str = "portable", release_bucket_mb: float = 64.0, tp: int = 1, wrap_layer=None):
    """The model of ``case``, sharded per decoder layer and at the root, and its optimizer; with
    ``activation_checkpointing`` each decoder layer recomputes its activations in backward (``wrap_layer``, a
    module class taking the layer, wraps each one instead: bench_fit's switchable checkpointing); with ``tp`` > 1
    tensor parallelism over groups of ``tp`` consecutive ranks (llama.tensor_parallel) and FSDP2 over the
    rest (a (world / tp, tp) mesh). Returns (model, optimizer, gradient-release handle or None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    if case not in FP32_CASES:
        model = model.to(torch.bfloat16)  # bf16 parameters; FlashAdamW keeps the rest of the master weight in rho
    mesh = None  # fully_shard's default: every rank
    if tp > 1:
        mesh = dp_tp_mesh(device, tp)
        tensor_parallel(model, mesh["tp"])
        mesh = mesh["dp"]
    if wrap_layer is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = wrap_layer(layer)
    elif activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 preserve_rng_state=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32 if cpu else torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if case == "adamw_fp32_master":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cpu)
    elif case in MUON_CASES:
        groups = flashdist.muon_param_groups(model)
        muon = dict(lr=1e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        if case == "flash_muon_24bit":
            opt = flashdist.FlashMuon(groups, **muon)
        else:
            opt = MuonWithAdamW([p for _, p in groups[0]["params"]],
                                [{"params": [p for _, p in g["params"]]} for g in groups[1:]], **muon)
    elif case.startswith("flash_"):
        opt = flashdist.FlashAdamW(model.parameters(), lr=1e-4, state_dict_format=state_dict_format)
    else:
        import flashoptim

        opt = flashoptim.FlashAdamW(model.parameters(), lr=1e-4, master_weight_bits=24)
    release = (flashdist.enable_gradient_release(model, opt, bucket_mb=release_bucket_mb) if case.endswith("release")
               else None)
    return model, opt, release


def dp_tp_mesh(device: torch.device, tp: int):
    """A (world / tp, tp) mesh named ("dp", "tp"): tensor-parallel groups of consecutive ranks (one node)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the {world} ranks")
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def run_case(case, cfg, args, device, rank):
    tp = getattr(args, "tp", 1)
    model, opt, release = build(case, cfg, device, args.cpu,
                                activation_checkpointing=getattr(args, "activation_checkpointing", False),
                                release_bucket_mb=getattr(args, "release_bucket_mb", 64.0), tp=tp)
    g = torch.Generator(device="cpu").manual_seed(rank // tp)  # the ranks of a tensor-parallel group: one batch
    x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    times, losses, report, phases = [], [], None, []
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        # GPU time of forward, backward (with release: the steps of the FSDP groups too) and step + zero_grad,
        # from events on the compute stream: no synchronization between the phases
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
        sync()
        t0 = time.perf_counter()
        if events:
            events[0].record()
        loss = model(x[:, :-1], x[:, 1:])
        if events:
            events[1].record()
        loss.backward()
        if events:
            events[2].record()
        if report is None:
            report = flashdist.memory_report(opt)  # before the step: gradients held (none under release)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if events:
            events[3].record()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            if events:
                phases.append([events[k].elapsed_time(events[k + 1]) for k in range(3)])
        losses.append(loss.item())
    after_step = flashdist.memory_report(opt)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)  # every rank's peak (they differ by their shards and buffers)
    n_local = report["numel"]
    persistent = (report["params"] + report["grads"] + after_step["total"] - after_step["params"]
                  - after_step["grads"]) / n_local
    row = {"case": case, "params_total": sum(p.numel() for p in model.parameters()), "params_rank0": n_local,
           "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
           "peak_gib_rank0": peak, "peak_gib_per_rank": peaks, "persistent_bytes_per_param": persistent,
           "memory_report": report,
           "first_loss": losses[0], "last_loss": losses[-1]}
    if phases:
        for k, name in enumerate(("forward", "backward", "optimizer")):  # optimizer: step() + zero_grad()
            row[f"{name}_ms_median"] = statistics.median(ph[k] for ph in phases)
    if release is not None:
        # batched optimizer calls per iteration: one per batch of FSDP groups and param group
        row["release_calls_per_step"] = release.optimizer_calls / (args.warmup + args.steps)
        release.remove()
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


class _CheckNet(torch.nn.Module):
    """For --check: every parameter gets a gradient; 'big' is large enough that its local shard takes the
    fused kernel's per-tensor launch, the others its table launch; 1-D parameters keep fp32 moments."""

    def __init__(self, div: int = 1):  # div > 1: every width divided, for a CPU smoke run
        super().__init__()
        torch.manual_seed(0)
        n = 16384 // div
        self.inp = torch.nn.Linear(1024, 8192 // div)
        self.big = torch.nn.Linear(8192 // div, n, bias=False)  # 134 M: 67 M per rank on 2 ranks
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(n, 512), torch.nn.Tanh(),
                                                              torch.nn.Linear(512, n)) for _ in range(2))
        self.norm = torch.nn.LayerNorm(n)

    def forward(self, x):
        x = self.big(torch.tanh(self.inp(x)))
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x).float().pow(2).mean()


def check_release_exact(device: torch.device, rank: int, steps: int = 3) -> dict:
    """Train the same model twice, FlashAdamW with and without gradient release, on the same batches, and
    compare every local parameter and state tensor bit for bit. Deterministic algorithms are requested,
    so that the two backward passes produce the same gradients."""
    from torch.distributed.fsdp import fully_shard

    torch.use_deterministic_algorithms(True, warn_only=True)
    runs = []
    for release in (False, True):
        model = _CheckNet(1 if device.type == "cuda" else 32).to(device=device, dtype=torch.bfloat16)
        for module in (model.inp, model.big, *model.blocks):
            fully_shard(module)
        fully_shard(model)
        opt = flashdist.FlashAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        handle = flashdist.enable_gradient_release(model, opt) if release else None
        g = torch.Generator(device="cpu").manual_seed(1 + rank)
        for _ in range(steps):
            model(torch.randn(64, 1024, generator=g).to(device, torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        tensors = []
        for p in model.parameters():
            tensors.append(p.to_local() if hasattr(p, "to_local") else p)
            for value in opt.state[p].values():
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
        runs.append([t.detach().clone() for t in tensors])
        calls = handle.optimizer_calls / steps if handle is not None else None
        if handle is not None:
            handle.remove()
        del model, opt
    differ = torch.tensor([sum(not torch.equal(a, b) for a, b in zip(*runs)), len(runs[0])], device=device)
    dist.all_reduce(differ)
    torch.use_deterministic_algorithms(False)
    return {"tensors_differing": int(differ[0]), "tensors": int(differ[1]), "release_calls_per_step": calls}


def paired_summary(rows: list[dict]) -> str:
    """Per case: its median step time in each round, and its ratio to AdamW's median of the same round
    (geometric mean and range over the rounds), so that a drift of the host between rounds cancels."""
    base = {r["round"]: r["step_ms_median"] for r in rows if r["case"] == "adamw_fp32_master" and "error" not in r}
    out = ["\nPer round (each round's cases back to back; ratio = case / AdamW of the same round):",
           "| optimizer | step ms, median per round | mean | vs AdamW, geometric mean | range |",
           "|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        done = [r for r in rows if r["case"] == case and "error" not in r]
        if not done:
            continue
        ms = [r["step_ms_median"] for r in done]
        ratios = [r["step_ms_median"] / base[r["round"]] for r in done if r["round"] in base]
        geo = f"{statistics.geometric_mean(ratios):.3f}x" if ratios else "-"
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        out.append(f"| {case} | {' / '.join(f'{m:.1f}' for m in ms)} | {statistics.mean(ms):.1f} | {geo} | {spread} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=ALL_CASES)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the cases this many times, each round starting one case later, and compare each "
                         "case with AdamW of the same round (the host's speed drifts between rounds)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke runs)")
    ap.add_argument("--release-bucket-mb", type=float, default=64.0,
                    help="gradient release's bucket_mb: MiB of gradient shards stepped per optimizer call")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: groups of TP consecutive ranks share each layer (torchtitan's "
                         "plan, launch/llama.py), FSDP2 over the WORLD / TP groups; batch is per group")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true",
                    help="first check that gradient release gives bit-identical parameters and state")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.check:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before its init
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = LlamaConfig.named(args.model)
    check = None
    if args.check:
        check = check_release_exact(device, rank)
        if rank == 0:
            print(json.dumps({"release_exactness_check": check}), flush=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    rows = []
    for rnd in range(args.rounds):
        k = rnd % len(args.cases)
        for case in args.cases[k:] + args.cases[:k]:
            row = run_or_record(case, lambda: run_case(case, cfg, args, device, rank), device)
            row["round"] = rnd
            rows.append(row)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k != "memory_report"}), flush=True)
    if rank == 0:
        base = {r["round"]: r for r in rows if r["case"] == "adamw_fp32_master" and "error" not in r}
        mesh = f"(dp, tp) = ({world // args.tp}, {args.tp})" if args.tp > 1 else "FSDP2"
        print(f"\n{args.model} Llama shapes, {world} ranks, {mesh}, {device.type}, batch {args.batch} x {args.seq} "
              "per rank" + (" group" if args.tp > 1 else ""))
        print("| optimizer | persistent B/param (rank 0) | peak GiB per rank | step ms (median) | vs AdamW |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | - | - | {r['error'][:60]} | |")
                continue
            same = base.get(r["round"])  # AdamW of the same round
            rel = f"{r['step_ms_median'] / same['step_ms_median']:.2f}x" if same else "-"
            peaks = " / ".join(f"{g:.1f}" for g in r["peak_gib_per_rank"])
            print(f"| {r['case']} | {r['persistent_bytes_per_param']:.2f} | {peaks} | "
                  f"{r['step_ms_median']:.1f} | {rel} |")
        if any("backward_ms_median" in r for r in rows):
            print("\nGPU time per phase, median (events on the compute stream; under release the backward")
            print("includes the steps of the FSDP groups):")
            print("| optimizer | forward ms | backward ms | step() + zero_grad() ms | iteration ms, min |")
            print("|---|---|---|---|---|")
            for r in rows:
                if "backward_ms_median" in r:
                    print(f"| {r['case']} | {r['forward_ms_median']:.1f} | {r['backward_ms_median']:.1f} | "
                          f"{r['optimizer_ms_median']:.1f} | {r['step_ms_min']:.1f} |")
        if args.rounds > 1:
            print(paired_summary(rows))
        flash = {r["case"]: r for r in rows if "error" not in r}
        if "flash_24bit" in flash and "flash_24bit_release" in flash:
            a, b = flash["flash_24bit"], flash["flash_24bit_release"]
            same = (a["first_loss"], a["last_loss"]) == (b["first_loss"], b["last_loss"])
            why = "equal" if same else ("not equal: the attention backward is not deterministic; --check "
                                        "compares release bit for bit on an MLP")
            print(f"\nrelease: {b['release_calls_per_step']:g} optimizer calls per step; last loss "
                  f"{b['last_loss']:.6f} vs {a['last_loss']:.6f} without release ({why})")
        if args.out:
            meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world": world,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args),
                    "release_exactness_check": check}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo's worker threads and the interpreter's shutdown: benchlib.exit_now
