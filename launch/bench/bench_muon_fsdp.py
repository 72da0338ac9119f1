"""FlashMuon's optimizer step under FSDP2 (and FSDP2 x tensor parallelism) on W ranks, against FlashAdamW and
against torch.optim.Muon's update run the simple sharded way; the step's phases, the division of the
Newton-Schulz work over the ranks, the bytes each rank communicates, memory, and an exactness check.

    torchrun --standalone --nproc_per_node=8 launch/bench/bench_muon_fsdp.py --model 8b --out runs/muon-fsdp-8b-8.json
    torchrun --standalone --nproc_per_node=8 launch/bench/bench_muon_fsdp.py --model 8b --tp 2 --out ...
    torchrun --standalone --nproc_per_node=2 launch/bench/bench_muon_fsdp.py --model tiny --cpu --seq 32  # smoke run

Cases (the model and its sharding from bench_fsdp.build: a Llama of ``--model`` shapes, FSDP2 per decoder
layer over all ranks, or over the WORLD / TP groups of a (dp, tp) mesh with ``--tp``; the matrices take Muon
and the embedding, head and norms AdamW, as ``flashdist.muon_param_groups`` splits them):
- ``flash_muon``: flashdist.FlashMuon, bf16 parameters + 24-bit masters, 8-bit momentum. Each matrix's
  update is gathered (bf16) to one owner rank, round-robin, orthogonalized there and sent back
  (flashdist.distributed.gather).
- ``muon_gathered``: torch.optim.Muon's update on the shards, the simple way (GatheredMuon below): fp32
  parameters and fp32 momentum on the local shard, every matrix's update all-gathered (bf16) to EVERY rank
  with ``DTensor.full_tensor()``, torch's own Newton-Schulz on the whole matrix on every rank, and each rank
  keeps its part; torch.optim.AdamW on the rest.
- ``flash_adamw``: flashdist.FlashAdamW on every parameter (no Newton-Schulz, no exchange).

Each row: the median over ``--steps`` (after ``--warmup``) of the time of ``optimizer.step()`` on rank 0
(CUDA events on the compute stream, after a real forward and backward), split into the orthogonalization's
exchange (gather, scatter and the wait for the owners: orthogonalization time less Newton-Schulz),
Newton-Schulz (the matmuls this rank computes), the AdamW groups, and the rest (Muon's elementwise phases:
momentum and the weight update). The phases are timed by wrapping, in this script only, the names
flashdist.optim.muon calls (OwnerOrthogonalize, flash_adam): the library runs unchanged. Per rank: the
matrices it orthogonalizes and their Newton-Schulz GFLOP per step (``ns_steps`` x (4 m^2 n + 2 m^3) for an
m x n matrix, m <= n), the bytes it sent and received in the optimizer's exchange per step over its local
Muon parameters (FlashMuon: gather.TRAFFIC, the padded bf16 buffers; the stated budget is 4 (W - 1) / W
bytes each way; muon_gathered: the bytes of the whole matrices it did not hold, 2 (W - 1) bytes per local
parameter received), persistent bytes per parameter (flashdist.memory_report: parameters + gradients +
state, over the local numel) and peak GPU memory over the timed iterations (forward, backward and step).
FSDP2's own all-gathers and reduce-scatters are the same for every case and not counted here. CPU gloo
times (``--cpu``) are for a smoke run, not performance.

``--check``: FlashMuon on the sharded model against one process (the whole model on each rank's device,
built from the same seed) on the same global gradients for ``--check-steps`` steps: parameters, master
weights and every state tensor, bit for bit. ``--save DIR`` writes a DCP checkpoint (flashdist.checkpoint)
before the last of those steps; ``--resume DIR`` (a second run, at another world size) loads it and takes
that last step only: the same bits; the run exits 1 if any tensor differs. Deterministic cuBLAS is requested
(CUBLAS_WORKSPACE_CONFIG). The one-process model needs the whole model and its state on one GPU (1B: about
8 GB; 8B: about 60 GB). ``bash launch/bench/muon_fsdp.sh GPUS`` runs every case, check and resume for a GPU count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import flashdist
import flashdist.optim.muon as muon_module
from flashdist import checkpoint
from flashdist.distributed import gather, placements as P
from flashdist.functional.muon import matrix_shape
from flashdist.optim.muon import NS_COEFFICIENTS

if __package__:  # python -m launch.bench.bench_muon_fsdp
    from ..benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, run_or_record, write_json
    from ..llama import Llama, LlamaConfig
    from .bench_fsdp import build
else:  # torchrun launch/bench/bench_muon_fsdp.py: its own folder is on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: benchlib, llama
    from bench_fsdp import build
    from benchlib import exit_now, free_memory, in_process_group, rank_and_device, run_meta, run_or_record, write_json
    from llama import Llama, LlamaConfig

CASES = ("flash_muon", "muon_gathered", "flash_adamw")
MUON = dict(lr=1e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")  # bench_fsdp.build's FlashMuon
NS_STEPS = 5
PHASES = ("exchange_ms", "newton_schulz_ms", "muon_elementwise_ms", "adamw_groups_ms")


def ns_gflop(shape) -> float:
    """Newton-Schulz GFLOP of one matrix of global ``shape``: per step X X^T, A A and B X."""
    m, n = sorted(matrix_shape(shape))
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3) / 1e9


class Phases:
    """Time named spans of one step: CUDA events on the current stream (read after a synchronize), or the
    host clock on the CPU. ``matrices`` collects the shapes this rank orthogonalized."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self):
        self.spans, self.matrices = defaultdict(list), []

    @contextlib.contextmanager
    def __call__(self, name: str):
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.spans[name].append(1e3 * (time.perf_counter() - t0))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.spans[name].append((start, end))

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        return {name: sum(s if isinstance(s, float) else s[0].elapsed_time(s[1]) for s in spans)
                for name, spans in self.spans.items()}


@contextlib.contextmanager
def timed_flash_muon(phases: Phases):
    """FlashMuon with its orthogonalization, Newton-Schulz and AdamW groups timed: the names
    flashdist.optim.muon calls, wrapped for the duration (the library's code is not changed)."""

    class TimedOwners(gather.OwnerOrthogonalize):
        def __call__(self, indices, updates, whole):
            def timed_whole(i, full):
                with phases("newton_schulz"):
                    out = whole(i, full)
                phases.matrices.append(tuple(full.shape))
                return out

            with phases("orthogonalize"):
                return super().__call__(indices, updates, timed_whole)

    def timed_adam(*args, **kwargs):
        with phases("adamw_groups"):
            flash_adam(*args, **kwargs)

    owners, flash_adam = muon_module.OwnerOrthogonalize, muon_module.flash_adam
    muon_module.OwnerOrthogonalize, muon_module.flash_adam = TimedOwners, timed_adam
    try:
        yield
    finally:
        muon_module.OwnerOrthogonalize, muon_module.flash_adam = owners, flash_adam


class GatheredMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update (``torch.optim._muon``'s own steps and Newton-Schulz) on FSDP2 / tensor-parallel
    DTensor matrices, the simple way: each rank keeps the fp32 momentum of its shard (the momentum and the
    weight update are elementwise, so the shard's values are those of the whole matrix), all-gathers the
    Nesterov update of every matrix to every rank as bf16 (``DTensor.full_tensor()``; torch's Newton-Schulz
    rounds to bf16 first, so this is its input bit for bit), runs Newton-Schulz on the whole matrix on
    every rank, and applies its own part. Every rank computes every matrix; each receives 2 (W - 1) bytes
    per local parameter. torch.optim.AdamW on ``adamw_groups``. Not torch's multi-device Muon (it has
    none): the baseline a user of torch.optim.Muon under FSDP2 writes first."""

    def __init__(self, matrices, adamw_groups, phases: Phases, *, lr, weight_decay, adjust_lr_fn, momentum=0.95):
        from torch.optim import _muon

        self._muon = _muon
        self.phases, self.received, self.sent = phases, 0, 0
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=(0.9, 0.95), foreach=True)
        defaults = dict(lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn, momentum=momentum)
        super().__init__([{"params": matrices}], defaults)
        self.adamw.state = self.state  # one state (distinct parameters), so that memory_report sees both
        self.param_groups += self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        group = self.param_groups[0]
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        with self.phases("adamw_groups"):
            self.adamw.step()
        for p in group["params"]:
            local, grad = p.to_local(), p.grad.to_local()
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum).bfloat16()
            with self.phases("orthogonalize"):
                whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()).full_tensor()
                with self.phases("newton_schulz"):
                    ortho = self._muon._zeropower_via_newtonschulz(whole, NS_COEFFICIENTS, NS_STEPS, 1e-7)
            self.phases.matrices.append(tuple(p.shape))
            self.received += (whole.numel() - update.numel()) * 2
            self.sent += update.numel() * 2 * (p.device_mesh.size() - 1)
            part = P.local_part(ortho, tuple(p.device_mesh.shape), p.device_mesh.get_coordinate(), p.placements)
            local.mul_(1 - lr * wd)
            local.add_(part, alpha=-self._muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def make(case, cfg, args, device, phases):
    if case == "flash_muon":
        return build("flash_muon_24bit", cfg, device, args.cpu, tp=args.tp)[:2]
    if case == "flash_adamw":
        return build("flash_24bit", cfg, device, args.cpu, tp=args.tp)[:2]
    model = build("adamw_fp32_master", cfg, device, args.cpu, tp=args.tp)[0]  # fp32 parameters; its AdamW unused
    groups = flashdist.muon_param_groups(model)
    return model, GatheredMuon([p for _, p in groups[0]["params"]], [{"params": [p for _, p in groups[1]["params"]]}],
                               phases, **MUON)


def run_case(case, cfg, args, device, rank, world) -> dict:
    phases = Phases(device)
    model, opt = make(case, cfg, args, device, phases)
    muon = [p for _, p in flashdist.muon_param_groups(model)[0]["params"]]
    g = torch.Generator(device="cpu").manual_seed(rank // args.tp)  # a tensor-parallel group shares its batch
    x = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    per_step, report = [], None
    hooks = timed_flash_muon(phases) if case == "flash_muon" else contextlib.nullcontext()
    with hooks:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                gather.TRAFFIC.update(sent=0, received=0)
                if isinstance(opt, GatheredMuon):
                    opt.sent = opt.received = 0
            model(x[:, :-1], x[:, 1:]).backward()
            report = report or flashdist.memory_report(opt)  # gradients held, before the first step
            phases.reset()
            with phases("step"):
                opt.step()
            per_step.append(phases.totals_ms())
            opt.zero_grad(set_to_none=True)
    timed = per_step[args.warmup:]
    ms = {name: statistics.median(t.get(name, 0.0) for t in timed) for name in timed[0]}
    after = flashdist.memory_report(opt)
    muon_local = sum(p.to_local().numel() for p in muon)
    sent, received = ((gather.TRAFFIC["sent"], gather.TRAFFIC["received"]) if case == "flash_muon" else
                      (opt.sent, opt.received) if case == "muon_gathered" else (0, 0))
    mine = {"step_ms": ms["step"], "owned_matrices": len(phases.matrices), "ns_gflop": sum(map(ns_gflop, phases.matrices)),
            "muon_params_local": muon_local,
            "sent_bytes_per_local_param": sent / args.steps / max(muon_local, 1),
            "received_bytes_per_local_param": received / args.steps / max(muon_local, 1),
            "sent_bytes": sent / args.steps,
            "persistent_bytes_per_param": (report["params"] + report["grads"] + after["total"] - after["params"]
                                           - after["grads"]) / report["numel"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    muon_total = sum(p.numel() for p in muon)
    row = {"case": case, "step_ms": ms.pop("step"), "newton_schulz_ms": ms.get("newton_schulz", 0.0),
           "exchange_ms": ms.get("orthogonalize", 0.0) - ms.get("newton_schulz", 0.0),
           "adamw_groups_ms": ms.get("adamw_groups", 0.0), "muon_matrices": len(muon), "muon_params": muon_total,
           "bytes_per_muon_param_all_ranks": sum(r["sent_bytes"] for r in ranks) / muon_total if muon else 0.0,
           "ranks": ranks}
    row["muon_elementwise_ms"] = row["step_ms"] - ms.get("orthogonalize", 0.0) - row["adamw_groups_ms"]
    if case == "flash_adamw":  # one AdamW step over every parameter: no phases apart
        row.update(exchange_ms=None, newton_schulz_ms=None, muon_elementwise_ms=None, adamw_groups_ms=None)
    del model, opt
    free_memory(device)
    return row


def global_grads(model, step: int, device) -> dict[str, torch.Tensor]:
    """The same global gradients on every rank (a seeded generator on the device), one per parameter."""
    gen = torch.Generator(device=device).manual_seed(1000 + step)
    return {name: 1e-3 * torch.randn(tuple(p.shape), generator=gen, device=device, dtype=p.dtype)
            for name, p in sorted(model.named_parameters())}


def check(cfg, args, device) -> dict:
    """FlashMuon sharded against one process on the same global gradients (the module docstring's
    ``--check``): returns the number of tensors that differ in any bit, of those compared."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(0)  # as bench_fsdp.build: the same initial weights
    with torch.device(device):
        ref = Llama(cfg).to(torch.bfloat16)
    ref_opt = flashdist.FlashMuon(flashdist.muon_param_groups(ref), **MUON)
    model = build("flash_muon_24bit", cfg, device, args.cpu, tp=args.tp)[0]
    opt = flashdist.FlashMuon(flashdist.muon_param_groups(model), **MUON)
    last = args.check_steps - 1
    for step in range(args.check_steps):
        grads = global_grads(ref, step, device)
        for name, p in ref.named_parameters():
            p.grad = grads[name]
        ref_opt.step()
        if args.resume and step < last:
            continue
        if args.resume and step == last:
            checkpoint.load(args.resume, model, opt)
        if args.save and step == last:
            checkpoint.save(args.save, model, opt)
        for name, p in model.named_parameters():
            p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
    differ = compared = 0
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = refs[name]
        pairs = [(p, r), (opt.master_weight(p), ref_opt.master_weight(r))]
        pairs += [(v, ref_opt.state[r][k]) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)]
        for a, b in pairs:
            a = a.full_tensor() if isinstance(a, DTensor) else a
            differ += not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            compared += 1
    del ref, ref_opt, model, opt
    free_memory(device)
    return {"tensors_differing": differ, "tensors_compared": compared, "steps": args.check_steps,
            "saved": args.save, "resumed": args.resume}


def table(rows, world) -> str:
    out = ["| optimizer | step ms | exchange ms | Newton-Schulz ms | Muon elementwise ms | AdamW groups ms | "
           "B/param held (rank 0) | peak GiB per rank |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['error'][:80]} | | | | | | |")
            continue
        peaks = " / ".join(f"{x['peak_gib']:.1f}" for x in r["ranks"])
        phases = " | ".join("-" if r[k] is None else f"{r[k]:.1f}" for k in PHASES)
        out.append(f"| {r['case']} | {r['step_ms']:.1f} | {phases} | "
                   f"{r['ranks'][0]['persistent_bytes_per_param']:.2f} | {peaks} |")
    out += ["", f"Per rank (the stated FlashMuon exchange: 4 (W - 1) / W = {4 * (world - 1) / world:.3f} B sent and "
            "as many received per local Muon parameter):",
            "| optimizer | matrices orthogonalized per rank | NS GFLOP per rank | B sent / B received per local Muon "
            "param | B per Muon param, all ranks |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" not in r and r["case"] != "flash_adamw":
            ranks = r["ranks"]
            owned = " / ".join(str(x["owned_matrices"]) for x in ranks)
            gflop = " / ".join(f"{x['ns_gflop']:.3g}" for x in ranks)
            wire = " / ".join(f"{x['sent_bytes_per_local_param']:.3f}, {x['received_bytes_per_local_param']:.3f}"
                              for x in ranks)
            out.append(f"| {r['case']} | {owned} of {r['muon_matrices']} | {gflop} | {wire} | "
                       f"{r['bytes_per_muon_param_all_ranks']:.3f} |")
    return "\n".join(out)


def run(args):
    rank, world, device = rank_and_device()
    cfg = LlamaConfig.named(args.model)
    result = {"rows": []}
    if args.check or args.save or args.resume:
        result["check"] = check(cfg, args, device)
        if rank == 0:
            print(json.dumps({"check": result["check"]}), flush=True)
        if rank == 0 and result["check"]["tensors_differing"]:
            print(f"bench_muon_fsdp: FlashMuon on {world} ranks differs from one process in "
                  f"{result['check']['tensors_differing']} tensors", file=sys.stderr)
    for case in args.cases:
        row = run_or_record(case, lambda: run_case(case, cfg, args, device, rank, world), device)
        result["rows"].append(row)
    if rank == 0 and result["rows"]:
        mesh = f"FSDP2 x TP (dp, tp) = ({world // args.tp}, {args.tp})" if args.tp > 1 else "FSDP2"
        print(f"\n{args.model} Llama shapes, {world} ranks, {mesh}, {device.type}, batch {args.batch} x {args.seq}; "
              f"optimizer step, median of {args.steps}, rank 0" + (" (CPU gloo: a smoke run, not performance)"
                                                                   if device.type == "cpu" else ""))
        print(table(result["rows"], world))
    if rank == 0:
        write_json(args.out, {"meta": run_meta(args, world, device), **result})
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=["1b", "8b", "tiny"])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES, help="none: --check only")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (bench_fsdp's --tp)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank (per tensor-parallel group)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU (smoke runs)")
    ap.add_argument("--check", action="store_true", help="first check FlashMuon against one process, bit for bit")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--save", default=None, help="--check, saving a DCP checkpoint here before its last step")
    ap.add_argument("--resume", default=None, help="--check's last step only, from the checkpoint --save wrote")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.check_steps < 1:
        ap.error(f"--steps and --check-steps must be at least 1, got {args.steps} and {args.check_steps}")
    if args.save and args.resume:
        ap.error("--save and --resume go in two runs: save at one world size, resume at another")
    if args.check or args.save or args.resume:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before its first use
    result = in_process_group(run, args)
    return 1 if result.get("check", {}).get("tensors_differing") else 0


if __name__ == "__main__":
    exit_now(main())  # gloo's worker threads and the interpreter's shutdown: benchlib.exit_now
