"""Peak host memory of `flashdist convert` / `flashdist export` against the checkpoint's size.

Builds a synthetic flashdist checkpoint (a Llama-shaped model: bf16 parameters, and per parameter the
optimizer state FlashAdamW saves: step, exp_avg, exp_avg_sq, rho; written one tensor at a time, so building it
needs little memory), then runs each conversion in a subprocess of its own and reads that child's peak RSS
(``os.wait4``'s ru_maxrss). The same conversions of a tiny checkpoint of the same structure give the fixed cost
(Python, torch, the imports); "growth" is the difference: the memory the conversion's data needs. A streaming
conversion's growth is about the largest tensor (plus a bounded buffer), not the checkpoint.

    python launch/bench/bench_convert_memory.py                          # small (fits a laptop), prints a table
    python launch/bench/bench_convert_memory.py --shape llama-3.1-8b --state compressed --work /big/disk \\
        --out runs/convert_memory_8b.json                            # Llama-3.1-8B shapes (~41 GB on disk)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {  # vocab, hidden, intermediate, layers, kv width
    "tiny": (64, 16, 32, 1, 16),
    "test": (4096, 256, 704, 24, 64),  # the test of the bound: many tensors, none large
    "small": (32000, 1024, 2816, 2, 256),
    "llama-3.1-8b": (128256, 4096, 14336, 32, 1024),
}
OPS = {
    "dcp->torch": ("convert", "{src}", "{dst}.pt", "--to", "torch"),
    "dcp->safetensors": ("convert", "{src}", "{dst}.safetensors", "--to", "safetensors"),
    "dcp->dcp compressed": ("convert", "{src}", "{dst}_dcp", "--to", "dcp", "--format", "compressed"),
    "export safetensors": ("export", "{src}", "{dst}_w.safetensors"),
    "export --hf bf16": ("export", "{src}", "{dst}_hf", "--hf", "--dtype", "bf16", "--max-shard-size", "2GB"),
}


def parameter_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    vocab, hidden, inter, layers, kv = SHAPES[shape]
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)})
    out.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return out


def build(path: Path, shape: str, state: str) -> dict:
    """Write the synthetic checkpoint as DCP, one tensor at a time. Returns its size and largest tensor."""
    import torch

    from flashdist.checkpoint.output import write_dcp
    from flashdist.checkpoint.state import FORMAT_VERSION

    params = parameter_shapes(shape)
    specs: dict[tuple, tuple] = {}
    for name, s in params.items():
        specs[("model", name)] = (s, torch.bfloat16)
    for name, s in params.items():
        if state == "none":
            break
        specs[("optim", "state", name, "step")] = ((), torch.float32)
        if state == "portable" or len(s) == 1:
            specs[("optim", "state", name, "exp_avg")] = (s, torch.float32)
            specs[("optim", "state", name, "exp_avg_sq")] = (s, torch.float32)
        else:
            groups = (s[0], -(-s[1] // 32))
            for m, dtype in (("exp_avg", torch.int8), ("exp_avg_sq", torch.uint8)):
                specs[("optim", "state", name, f"{m}_codes")] = (s, dtype)
                specs[("optim", "state", name, f"{m}_scales")] = (groups, torch.bfloat16)
        specs[("optim", "state", name, "rho")] = (s, torch.int8)
    group = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "master_weight_bits": 24,
             "quantize_states": True, "companded": True, "flat_layout": False, "params": list(params),
             "flashdist_format": "compressed" if state == "compressed" else "portable",
             "flashdist_version": FORMAT_VERSION}
    rest: dict = {"model": {n: None for n in params}, "extra": {"step": 10}}
    if state != "none":
        rest["optim"] = {"state": {n: {} for n in params}, "param_groups": [group]}
        for route in specs:
            if route[0] == "optim":
                rest["optim"]["state"][route[2]][route[3]] = None

    def make(route):
        g = torch.Generator().manual_seed(zlib.crc32(repr(route).encode()))
        s, dtype = specs[route]
        if dtype.is_floating_point:
            t = torch.randn(s, generator=g, dtype=torch.float32)
            return (t.abs() if route[-1] == "exp_avg_sq" else t).to(dtype)
        lo, hi = (0, 255) if dtype == torch.uint8 else (-127, 128)
        return torch.randint(lo, hi, s, generator=g, dtype=dtype)

    write_dcp(path, rest, specs, make)
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in specs.values()]
    return {"checkpoint_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors": len(sizes),
            "parameters": sum(torch.Size(s).numel() for s in params.values())}


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONWARNINGS="ignore")


def build_in_child(path: Path, shape: str, state: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--build", str(path), "--shape", shape, "--state", state],
                         env=_env(), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def peak_rss(argv: list[str]) -> tuple[int, float]:
    """Run ``python -m flashdist.cli ARGV`` and return its peak RSS in bytes and its wall time. (Linux starts a
    child's ru_maxrss at its parent's: this driver stays small, never importing torch, and builds the
    checkpoints in children of their own.)"""
    import time

    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flashdist.cli", *argv], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"flashdist {' '.join(argv)} failed: {err.strip()}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # Linux reports KiB


def measure(work: Path, shape: str, state: str, ops: list[str]) -> dict:
    base_src, src = work / "tiny_ckpt", work / f"{shape}_ckpt"
    build_in_child(base_src, "tiny", state)
    info = build_in_child(src, shape, state)
    rows = []
    for op in ops:
        fixed, _ = peak_rss([a.format(src=base_src, dst=work / "tiny_out") for a in OPS[op]])
        peak, seconds = peak_rss([a.format(src=src, dst=work / "out") for a in OPS[op]])
        for leftover in work.glob("*out*"):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        growth = peak - fixed
        rows.append({"op": op, "peak_rss_bytes": peak, "fixed_rss_bytes": fixed, "growth_bytes": growth,
                     "growth_over_checkpoint": growth / info["checkpoint_bytes"],
                     "growth_over_largest_tensor": growth / info["largest_tensor_bytes"], "seconds": seconds})
    return {"shape": shape, "state": state, **info, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="small")
    ap.add_argument("--state", choices=["portable", "compressed", "none"], default="portable",
                    help="optimizer state in the synthetic checkpoint (none: model weights only)")
    ap.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--work", default=None, help="folder for the checkpoint and outputs (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--build", default=None, help=argparse.SUPPRESS)  # (internal) write the checkpoint here
    args = ap.parse_args()
    if args.build:
        print(json.dumps(build(Path(args.build), args.shape, args.state)))
        return
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.work))
    try:
        result = measure(work, args.shape, args.state, args.ops)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    gib = 2**30
    print(f"{args.shape} ({result['parameters']:,} parameters, {args.state} optimizer state): checkpoint "
          f"{result['checkpoint_bytes'] / gib:.2f} GiB in {result['tensors']} tensors, largest tensor "
          f"{result['largest_tensor_bytes'] / gib:.3f} GiB")
    print(f"{'operation':<22} {'peak RSS GiB':>12} {'fixed GiB':>10} {'growth GiB':>11} {'/ckpt':>7} {'/largest':>9} "
          f"{'s':>7}")
    for r in result["rows"]:
        print(f"{r['op']:<22} {r['peak_rss_bytes'] / gib:>12.3f} {r['fixed_rss_bytes'] / gib:>10.3f} "
              f"{r['growth_bytes'] / gib:>11.3f} {r['growth_over_checkpoint']:>7.3f} "
              f"{r['growth_over_largest_tensor']:>9.2f} {r['seconds']:>7.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
