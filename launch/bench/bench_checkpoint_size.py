"""Optimizer checkpoint size on disk: FlashAdamW (portable, compressed) against torch.optim.AdamW.

Saves the optimizer state of one model with torch.distributed.checkpoint (one process, CPU), measures the
bytes written, prints a table and writes JSON.

    python launch/bench/bench_checkpoint_size.py --out runs/checkpoint_size.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import flashdist


def _model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Embedding(vocab, hidden)]
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden), torch.nn.LayerNorm(hidden)]
    return torch.nn.Sequential(*blocks)


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def measure(model: torch.nn.Module, make_opt) -> int:
    opt = make_opt(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=tmp)
        return _dir_bytes(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    cases = {
        "torch.optim.AdamW (fp32 params)": (torch.float32, lambda m: torch.optim.AdamW(m.parameters())),
        "FlashAdamW portable": (torch.bfloat16, lambda m: flashdist.FlashAdamW(m.parameters())),
        "FlashAdamW compressed": (torch.bfloat16, lambda m: flashdist.FlashAdamW(
            m.parameters(), state_dict_format="compressed")),
    }
    rows = []
    for name, (dtype, make) in cases.items():
        model = _model(args.hidden, args.layers, args.vocab).to(dtype)
        n = sum(p.numel() for p in model.parameters())
        size = measure(model, make)
        rows.append({"optimizer": name, "params": n, "bytes": size, "bytes_per_param": size / n})
    base = rows[0]["bytes"]
    for r in rows:
        r["vs_adamw"] = r["bytes"] / base
    print(f"| optimizer state checkpoint | params | bytes on disk | bytes/param | vs AdamW |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['params'] / 1e6:.2f} M | {r['bytes'] / 2**20:.1f} MiB | "
              f"{r['bytes_per_param']:.3f} | {100 * r['vs_adamw']:.1f}% |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args)}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
