"""Quality evidence: the same model, data and seeds trained with AdamW (fp32 master weights), FlashAdamW
24-bit and 32-bit, FlashAdamW with linear moments (companded=False, the paper's ablation), and bf16
without rho (master_weight_bits=None). Runs launch/train.py once per (variant, seed), in parallel over
the GPUs (several runs share a GPU: the model is small), or on the CPU with a tiny default config.

    python launch/convergence.py --out runs/convergence            # GPU: a ~11M-parameter model
    python launch/convergence.py --out runs/convergence --cpu      # CPU: a tiny model, short

Writes OUT/convergence.json (final validation loss per run, mean and spread per variant) and
OUT/convergence.png (validation curves), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "AdamW (fp32 master)": ["--optimizer", "adamw"],
    "FlashAdamW 24-bit": ["--optimizer", "flash", "--master-weight-bits", "24"],
    "FlashAdamW 32-bit": ["--optimizer", "flash", "--master-weight-bits", "32"],
    "FlashAdamW 24-bit, linear moments": ["--optimizer", "flash", "--no-companding"],
    "bf16 without rho": ["--optimizer", "flash", "--master-weight-bits", "none"],
}
GPU_MODEL = ["--d-model", "384", "--n-layer", "6", "--n-head", "6", "--seq-len", "256", "--batch-size", "64",
             "--lr", "2e-3", "--warmup", "100", "--eval-every", "100", "--eval-batches", "32", "--log-every", "100"]
CPU_MODEL = ["--d-model", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "64", "--batch-size", "16",
             "--lr", "3e-3", "--warmup", "10", "--eval-every", "25", "--eval-batches", "8", "--log-every", "25",
             "--corpus-mb", "4"]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="default: 2000 on GPU, 150 on CPU")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with a tiny model")
    ap.add_argument("--per-gpu", type=int, default=5, help="runs sharing one GPU at a time")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="subset of: " + ", ".join(VARIANTS))
    args = ap.parse_args()
    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    steps = args.steps or (2000 if gpus else 150)
    model = GPU_MODEL if gpus else CPU_MODEL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, seed) for seed in args.seeds for name in args.variants]
    slots = max(1, gpus * args.per_gpu) if gpus else max(1, (os.cpu_count() or 1))
    running: list[tuple[subprocess.Popen, str, int]] = []
    done: list[tuple[subprocess.Popen, str, int]] = []
    t0 = time.time()
    for i, (name, seed) in enumerate(jobs):
        while len(running) >= slots:
            done += [job for job in running if job[0].poll() is not None]
            running = [job for job in running if job[0].poll() is None]
            if len(running) >= slots:
                time.sleep(1)
        run_dir = out / f"{slug(name)}-seed{seed}"
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
        # the recipe runs the way this file runs (a module of the launch package, or a file)
        recipe = ["-m", f"{__package__}.train"] if __package__ else [str(HERE / "train.py")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *recipe,
               *VARIANTS[name], *model, "--steps", str(steps), "--seed", str(seed), "--out-dir", str(run_dir)]
        log = open(out / f"{slug(name)}-seed{seed}.log", "w")
        running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), name, seed))
        print(f"started {name} seed {seed}", flush=True)
    failed = [(n, s) for p, n, s in running + done if p.wait() != 0]
    results: dict[str, list[float]] = {}
    curves: dict[str, list[tuple[int, float]]] = {}
    for name, seed in jobs:
        summary_path = out / f"{slug(name)}-seed{seed}" / "summary.json"
        if not summary_path.exists():
            failed.append((name, seed))
            continue
        summary = json.loads(summary_path.read_text())
        results.setdefault(name, []).append(summary["final_val_loss"])
        if seed == args.seeds[0]:
            log_rows = [json.loads(line) for line in (summary_path.parent / "log.jsonl").read_text().splitlines()]
            curves[name] = [(r["step"], r["val_loss"]) for r in log_rows if "val_loss" in r]
    base = statistics.mean(results.get("AdamW (fp32 master)", [float("nan")]))
    rows = []
    for name in args.variants:
        vals = results.get(name, [])
        if not vals:
            continue
        mean = statistics.mean(vals)
        rows.append({"variant": name, "val_losses": vals, "mean": mean, "spread": max(vals) - min(vals),
                     "vs_adamw_pct": 100 * (mean - base) / base})
    print(f"\n{steps} steps, seeds {args.seeds}, {'GPU' if gpus else 'CPU'}, {time.time() - t0:.0f} s")
    print("| variant | final val loss (mean over seeds) | spread (max - min) | vs AdamW |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['mean']:.4f} | {r['spread']:.4f} | {r['vs_adamw_pct']:+.2f}% |")
    if failed:
        print(f"FAILED runs: {failed} (see the .log files in {out})")
    meta = {"steps": steps, "seeds": args.seeds, "device": "cuda" if gpus else "cpu", "model_args": model,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if gpus else None,
            "date": time.strftime("%Y-%m-%d")}
    (out / "convergence.json").write_text(json.dumps({"meta": meta, "rows": rows, "curves": curves}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, pts in curves.items():
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_title(f"byte-level GPT on the Python stdlib, seed {args.seeds[0]}")
        lo = min(v for pts in curves.values() for _, v in pts)
        ax.set_ylim(lo - 0.05, lo + 1.0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "convergence.png", dpi=120)
    except ImportError:
        pass
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
