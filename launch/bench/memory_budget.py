"""Per-GPU memory and communication of Llama-3.1 8B / 70B / 405B training under FSDP2 and HSDP, from
``flashdist.bytes_per_param``: AdamW with fp32 master weights against FlashAdamW with and without gradient
release. Activations are not counted (they depend on batch, sequence length and activation checkpointing).

    python launch/bench/memory_budget.py                       # the tables of docs/scaling.md
    python launch/bench/memory_budget.py --gpus 16 32 --out budget.json

Per GPU, for P parameters sharded over S ranks (S = every GPU under FSDP2, the GPUs of one node under HSDP):
- persistent: P / S x bytes per parameter (master weight, rho, gradient, moments);
- transient: FSDP2's unsharded buffers, for ``fully_shard`` per decoder layer and at the root: the root's
  parameters (embedding, head, final norm) in bf16, unsharded for the whole step, plus the larger of
  (two decoder layers in bf16, the computing one and the prefetched next one, with one layer's bf16
  gradient and the fp32 copy that is reduce-scattered) and (the root's bf16 gradient and its fp32 copy);
- communication per step, ring algorithms: forward and backward all-gather bf16 parameters
  (2 x 2P (S-1)/S), reduce-scatter fp32 gradients (4P (S-1)/S), and under HSDP an all-reduce of the fp32
  gradient shard across the R replicas (2 x 4P/S x (R-1)/R), the only traffic between nodes.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from flashdist import bytes_per_param
from flashdist.memory_plan import PRESETS

GIB = 2**30
# the memory the driver reports: H100 80 GB 81,559 MiB; H200 141 GB 143,771 MiB (docs/benchmarks.md's machine)
CARDS = {"80 GB": 81559 * 2**20, "141 GB": 143771 * 2**20}
OPTIMIZERS = {  # column -> (flashdist.bytes_per_param kind, gradient release)
    "AdamW (fp32 master)": ("adamw", False),
    "FlashAdamW": ("flash_adamw", False),
    "FlashAdamW + release": ("flash_adamw", True),
}
PARAM_BYTES, GRAD_REDUCE_BYTES = 2, 4  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)


# the shapes and the buffer formula are flashdist.memory_plan's (``flashdist plan``), which this table is a sweep of
MODELS = {"Llama-3.1-8B": PRESETS["llama-3.1-8b"], "Llama-3.1-70B": PRESETS["llama-3.1-70b"],
          "Llama-3.1-405B": PRESETS["llama-3.1-405b"]}


def layout(gpus: int, gpus_per_node: int, hsdp: bool) -> tuple[int, int]:
    """(replicas, shards): FSDP2 shards over every GPU; HSDP over the GPUs of a node, one replica per node."""
    if not hsdp or gpus <= gpus_per_node:
        return 1, gpus
    if gpus % gpus_per_node:
        raise ValueError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    return gpus // gpus_per_node, gpus_per_node


def budget(model: str, gpus: int, gpus_per_node: int = 8, hsdp: bool = False) -> dict:
    """One row: per-GPU bytes of each optimizer, transient buffers, communication, and the headroom per card."""
    shape = MODELS[model]
    p = shape.params()
    replicas, shards = layout(gpus, gpus_per_node, hsdp)
    transient = shape.buffer_bytes()
    ring = (shards - 1) / shards
    all_gather = 2 * PARAM_BYTES * p * ring
    reduce_scatter = GRAD_REDUCE_BYTES * p * ring
    all_reduce = 2 * GRAD_REDUCE_BYTES * p / shards * (replicas - 1) / replicas
    row = {"model": model, "params": p, "gpus": gpus, "layout": "HSDP" if replicas > 1 else "FSDP2",
           "replicas": replicas, "shards": shards, "transient_gib": transient / GIB,
           "all_gather_gib": all_gather / GIB, "reduce_scatter_gib": reduce_scatter / GIB,
           "all_reduce_gib": all_reduce / GIB,
           "between_nodes_gib": (all_reduce if replicas > 1 else
                                 (all_gather + reduce_scatter if gpus > gpus_per_node else 0.0)) / GIB,
           "optimizers": {}}
    for name, (kind, release) in OPTIMIZERS.items():
        parts = bytes_per_param(kind, gradient_release=release)
        persistent = p / shards * parts["total"]
        row["optimizers"][name] = {
            "bytes_per_param": parts["total"],
            "weights_gib": p / shards * (parts["master"] + parts["ecc"]) / GIB,
            "grads_gib": p / shards * parts["grad"] / GIB,
            "optimizer_state_gib": p / shards * (parts["m"] + parts.get("v", 0.0)) / GIB,
            "persistent_gib": persistent / GIB,
            "headroom_gib": {card: (size - persistent - transient) / GIB for card, size in CARDS.items()},
        }
    return row


def table(rows: list[dict]) -> str:
    """Markdown: per-GPU persistent GiB of each optimizer, and what is left of each card for activations."""
    names = list(OPTIMIZERS)
    head = ["model", "GPUs", "layout", *[f"{n}, GiB/GPU" for n in names], "transient GiB",
            *[f"left on {card}: {' / '.join(n.replace(' (fp32 master)', '') for n in names)}" for card in CARDS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        opt = r["optimizers"]
        mesh = f"{r['layout']} {r['replicas']}x{r['shards']}" if r["replicas"] > 1 else f"FSDP2 {r['shards']}"
        cells = [r["model"], str(r["gpus"]), mesh, *[f"{opt[n]['persistent_gib']:.1f}" for n in names],
                 f"{r['transient_gib']:.1f}"]
        for card in CARDS:
            cells.append(" / ".join(_fit(opt[n]["headroom_gib"][card]) for n in names))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fit(headroom: float) -> str:
    return f"{headroom:.0f}" if headroom >= 0 else "no"


def comm_table(rows: list[dict]) -> str:
    head = ["model", "GPUs", "layout", "all-gather GiB", "reduce-scatter GiB", "all-reduce GiB",
            "between nodes GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mesh = f"HSDP {r['replicas']}x{r['shards']}" if r["replicas"] > 1 else f"FSDP2 {r['shards']}"
        lines.append("| " + " | ".join([r["model"], str(r["gpus"]), mesh, f"{r['all_gather_gib']:.1f}",
                                        f"{r['reduce_scatter_gib']:.1f}", f"{r['all_reduce_gib']:.1f}",
                                        f"{r['between_nodes_gib']:.1f}"]) + " |")
    return "\n".join(lines)


def rows_for(models: list[str], gpus: list[int], gpus_per_node: int) -> list[dict]:
    rows = []
    for model in models:
        for n in gpus:
            rows.append(budget(model, n, gpus_per_node, hsdp=False))
            if n > gpus_per_node:
                rows.append(budget(model, n, gpus_per_node, hsdp=True))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 512], help="GPU counts (default: 8 64 512)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="HSDP shards over one node's GPUs (default 8)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.gpus_per_node < 1 or any(n < 1 for n in args.gpus):
        ap.error("--gpus and --gpus-per-node must be positive")
    bad = [n for n in args.gpus if n > args.gpus_per_node and n % args.gpus_per_node]
    if bad:
        ap.error(f"--gpus {bad} are not multiples of --gpus-per-node {args.gpus_per_node}: HSDP needs whole nodes")
    rows = rows_for(args.models, args.gpus, args.gpus_per_node)
    for model in args.models:
        print(f"{model}: {MODELS[model].params() / 1e9:.2f} B parameters, {asdict(MODELS[model])}")
    print("\nPer-GPU memory (activations excluded); 'left on' = GiB of the card left for activations, "
          "'no' = does not fit\n")
    print(table(rows))
    print("\nCommunication per GPU per step (GiB sent, ring algorithms; the same for every optimizer)\n")
    print(comm_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"cards_bytes": CARDS, "rows": rows}, indent=1))
        print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
