"""Train a byte-level GPT on installed Python sources (launch/data.py) with FSDP2 and a flashdist optimizer (or AdamW).

    torchrun --nproc_per_node=2 launch/train.py --steps 200 --ckpt-dir runs/ckpt --ckpt-every 100
    torchrun --nproc_per_node=2 launch/train.py --steps 300 --ckpt-dir runs/ckpt --resume

Across nodes (launch/multinode.sh, launch/slurm/train.sbatch), the same script under torchrun --nnodes:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=JOB \
        --max-restarts=3 launch/train.py --ckpt-dir /shared/ckpt --ckpt-every 100 --auto-resume

The mesh is ``--replicas`` x ``--shards`` ranks: by default HSDP with one replica group per node (each
parameter sharded over the ranks of a node, replicated across nodes, placements (Replicate(), Shard(0)));
``--replicas 1`` shards over every rank (plain FSDP2). ``--auto-resume`` continues from the last checkpoint
when one exists, which is what a restart by ``--max-restarts`` or a SLURM requeue needs.

CPU + gloo by default (one thread per rank), CUDA + NCCL when GPUs are present. Without torchrun it runs
in one process without FSDP2. ``--optimizer``: ``flash_adamw`` (the default; ``flash`` is the old name)
is FlashAdamW on bf16 parameters, ``flash_sgd`` FlashSGD (momentum 0.9, L2 decay as torch.optim.SGD) and
``flash_lion`` FlashLion, both on bf16 parameters too; ``adamw`` is torch.optim.AdamW with fp32 master
weights (fp32 parameters, bf16 compute through FSDP2's MixedPrecisionPolicy). ``--lr`` and
``--weight-decay`` default to values that suit each optimizer (DEFAULTS below). Writes ``summary.json``,
``log.jsonl`` (one row a step, written as the run goes) and ``loss.png`` into ``--out-dir``.

The corpus (launch/data.py) is the installed packages' Python sources, built once into ``--corpus-dir`` and
memory-mapped; ``--corpus-mb`` reads only the first files instead. ``--time-limit`` ends a run early (the
summary says ``"partial": true``); ``--save-weights`` / ``--init-from`` hand fp32 weights from one run to the
next (launch/convergence.py's fine-tuning phase).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import flashdist
from flashdist import checkpoint
from flashdist import distributed as D

if __package__:  # python -m launch.train
    from .benchlib import MuonWithAdamW, exit_now
    from .data import VOCAB, batch, load_corpus
    from .model import GPT, GPTConfig, clip_grad_norm_, tensor_parallel
else:  # run as a file (python or torchrun launch/train.py): its own folder is on sys.path
    from benchlib import MuonWithAdamW, exit_now
    from data import VOCAB, batch, load_corpus
    from model import GPT, GPTConfig, clip_grad_norm_, tensor_parallel

STARTED = time.perf_counter()  # --time-limit counts from here: imports and the corpus build included

# --optimizer -> default (lr, weight decay). Lion's sign update moves every coordinate by lr: a 3x smaller lr than
# AdamW's and a 3x larger decay (the same lr * weight_decay). SGD's update is lr times a gradient-sized momentum
# buffer, and its decay is L2 (added to the gradient, as torch.optim.SGD), so a small one. Measured on the CPU
# model of launch/convergence.py, 100 steps: SGD lr 0.1 beat 0.03, 0.3 and 1; Lion 1e-3 beat 3e-4.
# Muon (both): lr is AdamW's, through adjust_lr_fn="match_rms_adamw" (the update's RMS matched to AdamW's, so one lr
# and one decay serve the matrices and the AdamW-updated rest alike).
DEFAULTS = {"flash_adamw": (3e-3, 0.1), "adamw": (3e-3, 0.1), "flash_lion": (1e-3, 0.3), "flash_sgd": (0.1, 1e-4),
            "flash_muon": (3e-3, 0.1), "muon": (3e-3, 0.1)}
OPTIMIZERS = list(DEFAULTS) + ["flash"]  # flash: FlashAdamW's old name here
FP32_MASTERS = ("adamw", "muon")  # torch's optimizers: fp32 parameters, bf16 compute


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="flash_adamw",
                    help="flash_adamw (FlashAdamW), flash_sgd (FlashSGD), flash_lion (FlashLion), flash_muon "
                         "(FlashMuon) on bf16 parameters, or adamw (torch.optim.AdamW) / muon (torch.optim.Muon "
                         "+ AdamW) on fp32 parameters; flash = flash_adamw")
    ap.add_argument("--master-weight-bits", choices=["24", "32", "none"], default="24",
                    help="flash optimizers: rho bits (none = plain bf16 weights)")
    ap.add_argument("--no-companding", action="store_true", help="flash optimizers: linear 8-bit moments (ablation)")
    ap.add_argument("--no-quantize-states", action="store_true", help="flash optimizers: fp32 moments")
    ap.add_argument("--momentum", type=float, default=None, help="flash_sgd: momentum (default 0.9; 0: no buffer)")
    ap.add_argument("--state-dict-format", choices=["portable", "compressed"], default="portable")
    ap.add_argument("--grad-release", action="store_true", help="step each parameter during backward")
    ap.add_argument("--steps", type=int, default=200, help="length of the run (the LR schedule's horizon)")
    ap.add_argument("--stop-at", type=int, default=None, help="stop early at this step (resume later)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate; default: " + ", ".join(f"{k} {v[0]:g}" for k, v in DEFAULTS.items()))
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=None,
                    help="default: " + ", ".join(f"{k} {v[1]:g}" for k, v in DEFAULTS.items()))
    ap.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off; off with release)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--corpus-mb", type=float, default=None, help="cap the training bytes (default: all)")
    ap.add_argument("--corpus-dir", default="runs/corpus",
                    help="where the full corpus is built once and memory-mapped from (launch/data.py)")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile each transformer block; auto: on CUDA only (a compile error falls back "
                         "to eager with a warning)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds from start: stop (checkpointing when --ckpt-dir is set) once training has run "
                         "this long; the summary marks the run partial")
    ap.add_argument("--init-from", default=None,
                    help="start from these weights (a safetensors file written by --save-weights), rounded to "
                         "bf16 for every optimizer so that all variants start from the same point")
    ap.add_argument("--save-weights", default=None,
                    help="at the end, write the fp32 (master) weights to this safetensors file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--ckpt-dir", default=None, help="checkpoints go to CKPT_DIR/latest")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from CKPT_DIR/latest")
    ap.add_argument("--out-dir", default=None, help="default: runs/<optimizer>-seed<seed>")
    ap.add_argument("--compute-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="FSDP2 compute dtype; auto: bf16 on CUDA, fp32 on CPU (CPUs without bf16 matrix units "
                         "run bf16 matmuls ~10x slower). Parameters stay bf16 for FlashAdamW either way.")
    ap.add_argument("--no-fsdp", action="store_true", help="plain single-process model even under torchrun")
    ap.add_argument("--replicas", type=int, default=None,
                    help="HSDP replica groups (the mesh's first dim); default: the number of nodes "
                         "(WORLD_SIZE / LOCAL_WORLD_SIZE); 1 = plain FSDP2 over every rank")
    ap.add_argument("--shards", type=int, default=None,
                    help="ranks each parameter is sharded over (the mesh's second dim); default: "
                         "WORLD_SIZE / replicas. replicas x shards must equal WORLD_SIZE")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: each block's linear layers split over groups of TP consecutive "
                         "ranks (torchtitan's plan, launch/model.py); FSDP2/HSDP over WORLD_SIZE / TP groups, "
                         "whose ranks share one batch")
    ap.add_argument("--auto-resume", action="store_true",
                    help="continue from CKPT_DIR/latest when it exists, else start at step 0 (restarts by "
                         "torchrun --max-restarts, SLURM requeues)")
    ap.add_argument("--same-batch", action="store_true",
                    help="every rank reads the batch of the single-process run: the numbers no longer depend "
                         "on the mesh, so a multi-node run can be checked bit for bit against one process "
                         "(a check, not a way to train: it adds no data per rank)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per rank; default: the node's cores / ranks on the node")
    args = ap.parse_args(argv)
    if args.optimizer == "flash":
        args.optimizer = "flash_adamw"
    lr, weight_decay = DEFAULTS[args.optimizer]
    args.lr = lr if args.lr is None else args.lr
    args.weight_decay = weight_decay if args.weight_decay is None else args.weight_decay
    if args.grad_release and args.clip:
        ap.error("--grad-release steps during backward, before a global gradient norm exists: use --clip 0")
    if (args.resume or args.auto_resume) and not args.ckpt_dir:
        ap.error("--resume and --auto-resume need --ckpt-dir")
    if args.optimizer == "muon" and args.ckpt_dir:
        ap.error("--ckpt-dir: --optimizer muon (torch.optim.Muon + AdamW, the comparison baseline) does not "
                 "checkpoint; use --optimizer flash_muon or leave out --ckpt-dir")
    for name in ("replicas", "shards", "threads", "tp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.optimizer in FP32_MASTERS and (args.grad_release or args.no_companding or args.master_weight_bits != "24"):
        ap.error("--grad-release, --no-companding and --master-weight-bits are options of the flash optimizers")
    if args.time_limit is not None and args.time_limit <= 0:
        ap.error(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    if args.init_from and not Path(args.init_from).is_file():
        ap.error(f"--init-from {args.init_from}: no such file (write one with --save-weights)")
    if args.momentum is not None and args.optimizer != "flash_sgd":
        ap.error("--momentum is a flash_sgd option")
    args.momentum = 0.9 if args.momentum is None else args.momentum
    return args


def mesh_shape(world: int, local_world: int, replicas: int | None = None,
               shards: int | None = None) -> tuple[int, int]:
    """(replicas, shards) for ``world`` ranks, ``local_world`` of them per node: by default one replica group
    per node (HSDP: shard within a node, where the links are fast; replicate across nodes). Raises
    ValueError naming the flag when the shape cannot cover the ranks."""
    if world % local_world:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}: every node "
                         "must run the same number of ranks (torchrun --nproc-per-node)")
    if replicas is None:
        replicas = world // shards if shards and world % shards == 0 else world // local_world
    if shards is None:
        shards = world // replicas if world % replicas == 0 else 0
    if replicas * shards != world:
        raise ValueError(f"--replicas {replicas} x --shards {shards or '?'} does not cover the {world} ranks: "
                         f"choose them so that replicas x shards = {world}")
    return replicas, shards


def worker_store() -> dist.Store:
    """The store a torchrun worker's process group meets in, namespaced to this incarnation of the job.

    Two cases, as torchrun sets them up:

    - The agents share their store with the workers (torch's default, ``TORCHELASTIC_USE_AGENT_STORE=True``): the
      workers meet in the TCPStore of the rank-0 agent, which outlives a restart after a failure. The keys of
      the failed incarnation (its ranks' addresses) are still there, and in torch 2.13 the workers of the
      restart read them (their store prefix is the LOCAL restart count, which differs between a node whose
      worker failed and one whose workers were only restarted), so the new process group never forms. The
      joins are counted in the store instead: every rank of an incarnation joins once, so
      (joins - 1) // world_size numbers the incarnations alike on every node (a rank that dies before it
      joins, at import, shifts the count: that job fails at the process-group timeout and needs a fresh
      start, which --auto-resume continues).
    - They do not (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as launch/multinode.sh sets): rank 0's worker
      serves a new store at the address its agent published, as torch's ``env://`` rendezvous would make it.
      It is made here so that :meth:`Run.close` can keep rank 0 serving it until every rank is done with it.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(minutes=10)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
        incarnation = (store.add("flashdist/joins", 1) - 1) // world
        return dist.PrefixStore(f"flashdist/incarnation{incarnation}", store)
    # multi_tenant: as env://, so that another store of this process may serve the same port
    return dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)


class Run:
    """Process-group, device and logging plumbing."""

    def __init__(self, threads: int | None = None):
        self.distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) >= 1 and "MASTER_ADDR" in os.environ
        self.cuda = torch.cuda.is_available()
        if self.distributed:
            local = int(os.environ.get("LOCAL_RANK", 0))
            if self.cuda:
                torch.cuda.set_device(local)
            self.store = worker_store()
            # the process group's keys apart from close()'s, as init_process_group keeps them apart from others'
            dist.init_process_group("nccl" if self.cuda else "gloo", store=dist.PrefixStore("default_pg", self.store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) if self.distributed else 1
        if not self.cuda:  # the ranks of a node share its cores
            torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // self.local_world))

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a file that rank 0 sees decides for all)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(t, 0)
        return bool(t.item())

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def mean(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world

    def memory_gib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

    def close(self, timeout: float = 60.0):
        """Leave the process group; every rank calls it at the end of a run.

        Rank 0's process may serve the workers' store (``worker_store``), which has to outlive every rank that
        may still use it, so rank 0 leaves last: it returns only when every rank has said, through the store,
        that it has destroyed its process group (or after ``timeout`` seconds, with a warning: a rank that has
        not arrived by then is stuck or gone)."""
        if not self.distributed:
            return
        dist.barrier()  # every rank is past its last collective before any rank tears its process group down
        dist.destroy_process_group()
        self.store.set(f"flashdist/closed/{self.rank}", "1")
        if self.rank == 0:
            try:
                self.store.wait([f"flashdist/closed/{r}" for r in range(self.world)], timedelta(seconds=timeout))
            except dist.DistError as e:
                print(f"train.py: not every rank had closed its process group after {timeout:g} s; rank 0 exits "
                      f"anyway ({str(e).splitlines()[0]})", flush=True)


def build(args, run: Run):
    cfg = GPTConfig(vocab=VOCAB, seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    if args.init_from:
        from safetensors.torch import load_file

        # through bf16 for every optimizer: the fp32-master run starts from the very values the bf16 runs hold
        weights = {k: v.to(torch.bfloat16).float() for k, v in load_file(args.init_from).items()}
        model.load_state_dict(weights)
    model = model.to(run.device)
    if args.optimizer not in FP32_MASTERS:
        model = model.to(torch.bfloat16)
    if args.compile == "on" or (args.compile == "auto" and run.cuda):
        from torch._dynamo import config as dynamo_config

        dynamo_config.suppress_errors = True  # a block that fails to compile runs eagerly
        for block in model.blocks:  # before fully_shard, as torchtitan does: one compiled graph per block
            block.compile(fullgraph=True)
    if run.distributed and not args.no_fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        replicas, shards = args.mesh
        # a 1-D mesh is FSDP2; a 2-D one is HSDP: (Replicate(), Shard(0)), the shard groups being runs of
        # consecutive ranks, which torchrun places on one node; --tp adds an innermost tp dim (consecutive
        # ranks, the fastest links) and FSDP2 / HSDP shard over the dims before it
        dims = [("replicate", replicas)] * (replicas > 1) + [("shard", shards)] + [("tp", args.tp)] * (args.tp > 1)
        mesh = init_device_mesh(run.device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
        if args.tp > 1:
            tensor_parallel(model, mesh["tp"])
        mesh = mesh["replicate", "shard"] if replicas > 1 else mesh["shard"]

        compute = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
            args.compute_dtype, torch.bfloat16 if run.cuda else torch.float32)
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "pos"]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or n == "pos"]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Muon: the block matrices; embedding, head, position table and 1-D parameters take AdamW (muon_param_groups)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [{"params": [p for p in g["params"] if not any(p is m for m in matrices)],
             "weight_decay": g["weight_decay"]} for g in groups]
    muon_kwargs = dict(lr=args.lr, weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw")
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=True)
    elif args.optimizer == "muon":
        opt = MuonWithAdamW(matrices, rest, **muon_kwargs)
    elif args.optimizer == "flash_muon":
        bits = None if args.master_weight_bits == "none" else int(args.master_weight_bits)
        opt = flashdist.FlashMuon([{"params": matrices, "use_muon": True}]
                                  + [{**g, "use_muon": False} for g in rest], **muon_kwargs,
                                  adamw_betas=(0.9, 0.95), master_weight_bits=bits,
                                  quantize_states=not args.no_quantize_states,
                                  state_dict_format=args.state_dict_format)
    else:
        bits = None if args.master_weight_bits == "none" else int(args.master_weight_bits)
        common = dict(lr=args.lr, master_weight_bits=bits, companded=not args.no_companding,
                      quantize_states=not args.no_quantize_states, state_dict_format=args.state_dict_format)
        if args.optimizer == "flash_sgd":
            opt = flashdist.FlashSGD(groups, momentum=args.momentum, **common)
        elif args.optimizer == "flash_lion":
            opt = flashdist.FlashLion(groups, betas=(0.9, 0.99), **common)
        else:
            opt = flashdist.FlashAdamW(groups, betas=(0.9, 0.95), **common)
    min_ratio = args.min_lr_ratio

    def schedule(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return model, opt, sched


@torch.no_grad()
def evaluate(model, val, args, run: Run) -> float:
    g = torch.Generator().manual_seed(10_000 + (0 if args.same_batch else run.rank // args.tp))
    losses = []
    for _ in range(args.eval_batches):
        x, y = batch(val, args.batch_size, args.seq_len, g)
        losses.append(model(x.to(run.device), y.to(run.device)).item())
    return run.mean(sum(losses) / len(losses))


def plot(log: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log if "loss" in r]
    ax.plot(steps, [r["loss"] for r in log if "loss" in r], label="train", lw=1)
    ev = [r for r in log if "val_loss" in r]
    ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@torch.no_grad()
def bf16_weights(model) -> list[torch.Tensor]:
    """Each parameter's local shard as bf16 (the values the model computes with)."""
    return [D.local(p).to(torch.bfloat16, copy=True) for p in model.parameters()]


@torch.no_grad()
def moved_fraction(before: list[torch.Tensor], model, run: Run) -> float:
    """The share of weights whose bf16 value changed in the step since ``before``: without rho, an update
    below half a bf16 spacing is lost and this share falls towards 0."""
    counts = torch.zeros(2, dtype=torch.float64, device=run.device)
    for old, p in zip(before, model.parameters()):
        counts[0] += (D.local(p).to(torch.bfloat16) != old).sum()
        counts[1] += old.numel()
    if run.distributed:
        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def save_weights(model, opt, path: str, run: Run) -> None:
    """The fp32 weights (flash optimizers: bf16 parameter + rho) as one safetensors file, written by rank 0."""
    if not isinstance(opt, flashdist.FlashOptimizer):
        weights = {n: D.full_tensor(p.detach()).float().cpu() for n, p in model.named_parameters()}
    else:
        weights = checkpoint.export_fp32_state_dict(model, opt)
    if run.rank == 0:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, path)


def _number(value, spec: str) -> str:
    """``value`` formatted, or "-" when the run has none (a run resumed at its last step takes no step)."""
    return "-" if value is None else format(value, spec)


def main(argv=None) -> dict:
    args = parse_args(argv)
    run = Run(args.threads)
    try:
        if run.world % args.tp or run.local_world % args.tp:
            raise ValueError(f"--tp {args.tp} must divide the ranks per node ({run.local_world}): a tensor-parallel "
                             "group stays inside a node")
        args.mesh = mesh_shape(run.world // args.tp, run.local_world // args.tp, args.replicas, args.shards)
    except ValueError as e:
        run.close()
        raise SystemExit(f"train.py: {e}") from None
    out = Path(args.out_dir or f"runs/{args.optimizer}-seed{args.seed}")
    if run.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    max_bytes = int(args.corpus_mb * 2**20) if args.corpus_mb else None
    if max_bytes is None and run.distributed and int(os.environ.get("LOCAL_RANK", 0)) != 0:
        dist.barrier()  # the node's first rank builds the corpus cache, the others then map it
    train, val, corpus = load_corpus(max_bytes, args.corpus_dir)
    if max_bytes is None and run.distributed and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        dist.barrier()
    model, opt, sched = build(args, run)
    release = flashdist.enable_gradient_release(model, opt) if args.grad_release else None
    n_params = sum(p.numel() for p in model.parameters())
    layout = "one process" if not run.distributed or args.no_fsdp else (
        f"FSDP2 over {args.mesh[1]} ranks" if args.mesh[0] == 1 else
        f"HSDP: {args.mesh[0]} replicas x {args.mesh[1]} shards") + (f" x TP {args.tp}" if args.tp > 1 else "")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    run.print(f"{layout}" + (f" | restart {restarts}" if restarts else ""))
    start, log = 0, []
    ckpt = Path(args.ckpt_dir) / "latest" if args.ckpt_dir else None
    if args.auto_resume:
        # a damaged checkpoint counts as present, so that load() reports it instead of a fresh start overwriting it
        args.resume = run.agree(ckpt.exists() or ckpt.with_name(ckpt.name + ".old").exists())
    if args.resume:
        extra = checkpoint.load(ckpt, model, opt)
        sched.load_state_dict(extra["scheduler"])
        start, log = int(extra["step"]), json.loads(extra["log"])
        run.print(f"resumed from {ckpt} at step {start}")
    run.print(f"flashdist {flashdist.__version__} | torch {torch.__version__} | {run.world} rank(s) on "
              f"{run.device.type} | {n_params / 1e6:.2f} M params | corpus {corpus['train_bytes'] / 2**20:.1f} MiB "
              f"train / {corpus['val_bytes'] / 2**20:.1f} MiB val from {', '.join(corpus['roots'].values())}")
    # distinct tokens a step trains on: a tensor-parallel group reads one batch, and --same-batch gives every
    # rank the single-process run's batch
    tokens_per_step = args.batch_size * args.seq_len * (1 if args.same_batch else run.world // args.tp)
    data_rank = run.rank // args.tp  # the ranks of a tensor-parallel group read the same batch
    report = None
    t0, tokens = time.perf_counter(), 0
    end = min(args.steps, args.stop_at or args.steps)
    if args.init_from and start == 0:  # the curve starts at the weights it fine-tunes
        log.append({"step": 0, "tokens": 0, "val_loss": evaluate(model, val, args, run)})
    log_file = None
    if run.rank == 0:  # the curve is on disk as it grows: a run killed by a time limit leaves what it reached
        log_file = open(out / "log.jsonl", "w")
        log_file.write("".join(json.dumps(r) + "\n" for r in log))
        log_file.flush()
    for step in range(start, end):
        if args.time_limit and end > step + 1 and run.agree(time.perf_counter() - STARTED > args.time_limit):
            run.print(f"--time-limit {args.time_limit:g} s reached: step {step + 1} of {args.steps} is the last")
            end = step + 1  # evaluated and checkpointed as the last step
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + (0 if args.same_batch else data_rank))
        x, y = batch(train, args.batch_size, args.seq_len, g)
        loss = model(x.to(run.device), y.to(run.device))
        loss.backward()
        if args.clip:
            if args.tp > 1:  # blocks on the (dp, tp) mesh, the rest on the dp mesh: torch's clip needs one mesh
                clip_grad_norm_(list(model.parameters()), args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if report is None or step == end - 1:
            report = flashdist.memory_report(opt)  # with the gradients still held (none under release)
        evaluating = (step + 1) % args.eval_every == 0 or step + 1 == end
        before = bf16_weights(model) if evaluating and release is None else None  # release: already stepped
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        tokens += tokens_per_step
        row = {"step": step + 1, "tokens": (step + 1) * tokens_per_step, "loss": run.mean(loss.item()),
               "lr": sched.get_last_lr()[0]}
        if before is not None:  # before evaluating: its forward leaves the FSDP2 root's parameters unsharded
            row["bf16_moved"] = moved_fraction(before, model, run)
        if evaluating:
            row["val_loss"] = evaluate(model, val, args, run)
        log.append(row)
        if log_file:
            log_file.write(json.dumps(row) + "\n")
            log_file.flush()
        if (step + 1) % args.log_every == 0 or "val_loss" in row:
            dt = time.perf_counter() - t0
            run.print(f"step {step + 1:5d} | loss {row['loss']:.4f}"
                      + (f" | val {row['val_loss']:.4f}" if "val_loss" in row else "")
                      + f" | {tokens / dt:,.0f} tok/s | mem {run.memory_gib():.2f} GiB"
                      + f" | {report['bytes_per_param']:.2f} B/param")
        if ckpt and args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == end):
            checkpoint.save(ckpt, model, opt, extra={"step": step + 1, "scheduler": sched.state_dict(),
                                                     "log": json.dumps(log)})
            run.print(f"saved {ckpt} at step {step + 1}")
        if step + 1 == end:
            break
    elapsed = time.perf_counter() - t0
    if log_file:
        log_file.close()
    if release is not None:
        release.remove()
    if args.save_weights:
        save_weights(model, opt, args.save_weights, run)
        run.print(f"saved the weights to {args.save_weights}")
    last_val = next((r["val_loss"] for r in reversed(log) if "val_loss" in r), float("nan"))
    summary = {
        "optimizer": args.optimizer, "master_weight_bits": args.master_weight_bits,
        "companded": not args.no_companding, "grad_release": args.grad_release, "seed": args.seed,
        "world_size": run.world, "mesh": list(args.mesh) if run.distributed else None, "device": run.device.type, "params": n_params, "steps": end,
        "partial": end < args.steps, "tokens": end * tokens_per_step,
        "resumed_from": start, "final_train_loss": log[-1].get("loss") if log else None, "final_val_loss": last_val,
        "tokens_per_s": tokens / elapsed if elapsed else None, "peak_mem_gib": run.memory_gib(),
        "bytes_per_param": report["bytes_per_param"] if report else None, "memory_report": report,
        "checkpoint": str(ckpt) if ckpt else None, "corpus": corpus, "torch": torch.__version__,
    }
    if run.rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        png = out / "loss.png"
        summary["plot"] = str(png) if plot(log, png, f"{args.optimizer} ({run.world} ranks)") else None
        rows = [("optimizer", args.optimizer + ("" if args.optimizer in FP32_MASTERS else f" ({args.master_weight_bits}-bit)")),
                ("ranks x device", f"{run.world} x {run.device.type}"), ("parameters", f"{n_params:,}"),
                ("steps", f"{start} -> {end}"), ("final train loss", f"{summary['final_train_loss'] or float('nan'):.4f}"),
                ("final val loss", f"{last_val:.4f}"),
                ("bytes/param held (measured, rank 0)", _number(summary["bytes_per_param"], ".3f")),
                ("throughput", _number(summary["tokens_per_s"], ",.0f") + " tok/s"), ("checkpoint", summary["checkpoint"]),
                ("loss plot", summary["plot"]), ("summary", str(out / "summary.json"))]
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
    run.close()
    return summary


if __name__ == "__main__":
    main()
    exit_now()
