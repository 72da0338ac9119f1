"""Quality evidence: the same model, data and seeds trained with AdamW (fp32 master weights), FlashAdamW 24-bit and
32-bit, FlashAdamW with linear moments (companded=False, the paper's ablation), and bf16 without rho
(master_weight_bits=None), then a low-learning-rate phase where rho matters. Runs launch/train.py once per
(variant, seed), all runs of a phase side by side (processes sharing the GPUs), and summarises.

Phases:
  main  pre-training from scratch, cosine schedule. AdamW and FlashAdamW 24-bit with --seeds, the three
        ablations with --ablation-seeds.
  rho   fine-tuning from AdamW's final weights (main phase, first seed; rounded to bf16 for every variant) at a
        small constant learning rate, where most Adam updates are below half a bf16 spacing: AdamW, FlashAdamW
        24-bit and bf16 without rho with --rho-seeds (the seed sets the data order).

    python launch/convergence.py --config gpt2-small --out runs/convergence --time-budget 480   # one H200
    python launch/convergence.py --config tiny --out runs/convergence-cpu                        # CPU, minutes

Every run writes its curve (log.jsonl: tokens, train loss, validation loss) as it goes, so a run stopped by
--time-budget still counts up to the tokens it reached; the report says which runs are partial. With --ckpt
the runs checkpoint and a later invocation with the same arguments continues them (a long run split over
several time-limited commands); finished runs are not run again.

Writes OUT/convergence.json (every run's status and curve, per-variant statistics), OUT/convergence.md (the
tables), OUT/convergence.png and OUT/rho.png (validation curves with seed bands), OUT/corpus.json (what was
trained on). --summarize only rebuilds these from the run directories (give it the arguments of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ADAMW, FLASH24, NO_RHO = "AdamW (fp32 master)", "FlashAdamW 24-bit", "bf16 without rho"
VARIANTS = {
    ADAMW: ["--optimizer", "adamw"],
    FLASH24: ["--optimizer", "flash_adamw", "--master-weight-bits", "24"],
    "FlashAdamW 32-bit": ["--optimizer", "flash_adamw", "--master-weight-bits", "32"],
    "FlashAdamW 24-bit, linear moments": ["--optimizer", "flash_adamw", "--no-companding"],
    NO_RHO: ["--optimizer", "flash_adamw", "--master-weight-bits", "none"],
}
# Muon: torch.optim.Muon (+ AdamW on the embedding, head and 1-D parameters) with fp32 masters, against FlashMuon and
# its ablations; lr is AdamW's through adjust_lr_fn="match_rms_adamw" (launch/train.py)
MUON, FLASHMUON = "torch Muon (fp32 master)", "FlashMuon 24-bit"
VARIANTS.update({
    MUON: ["--optimizer", "muon"],
    FLASHMUON: ["--optimizer", "flash_muon", "--master-weight-bits", "24"],
    "FlashMuon, bf16 without rho": ["--optimizer", "flash_muon", "--master-weight-bits", "none"],
    "FlashMuon 24-bit, fp32 momentum": ["--optimizer", "flash_muon", "--no-quantize-states"],
})
ADAMW_FAMILY = [name for name in VARIANTS if "Muon" not in name]
REFERENCE = {name: MUON if "Muon" in name else ADAMW for name in VARIANTS}  # the "vs" column's baseline
SEEDED = (ADAMW, FLASH24, MUON, FLASHMUON)  # the variants run with every seed of --seeds
RHO_VARIANTS = (ADAMW, FLASH24, NO_RHO)

# Shapes. gpt2-small: GPT-2 small's 12 layers, d_model 768, 12 heads and 1024 context, with a 256-byte vocabulary
# instead of 50257 BPE tokens, so 86 M parameters instead of 124 M (the embedding table is what shrinks).
CONFIGS = {
    # 16 x 1024 bytes a step: about 8 GB of activations a run, so 7 runs fit on one 141 GB card with room to spare
    "gpt2-small": {"model": ["--d-model", "768", "--n-layer", "12", "--n-head", "12", "--seq-len", "1024",
                             "--batch-size", "16", "--eval-batches", "32"],
                   "lr": 1e-3, "steps": 480, "eval_every": 80, "rho_lr": 3e-5, "rho_steps": 240, "rho_eval_every": 60},
    "tiny": {"model": ["--d-model", "64", "--n-layer", "2", "--n-head", "2", "--seq-len", "64", "--batch-size", "16",
                       "--eval-batches", "8", "--corpus-mb", "4"],
             "lr": 3e-3, "steps": 150, "eval_every": 25, "rho_lr": 3e-5, "rho_steps": 100, "rho_eval_every": 20},
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/convergence", help="run directories and the report")
    ap.add_argument("--config", choices=list(CONFIGS), default=None, help="default: gpt2-small on CUDA, tiny on CPU")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    ap.add_argument("--phases", nargs="+", choices=["main", "rho"], default=["main", "rho"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help=f"main phase seeds of {' and '.join(SEEDED)}")
    ap.add_argument("--ablation-seeds", type=int, nargs="+", default=[0], help="main phase seeds of the others")
    ap.add_argument("--variants", nargs="+", default=ADAMW_FAMILY, metavar="NAME",
                    help="main phase subset of: " + "; ".join(VARIANTS) + " (default: the AdamW family)")
    ap.add_argument("--steps", type=int, default=None, help="main phase steps (the cosine horizon)")
    ap.add_argument("--lr", type=float, default=None, help="main phase peak learning rate")
    ap.add_argument("--rho-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rho-steps", type=int, default=None)
    ap.add_argument("--rho-lr", type=float, default=None, help="rho phase constant learning rate")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole invocation; runs still going near the end stop and count as partial")
    ap.add_argument("--rho-share", type=float, default=0.35, help="share of --time-budget kept for the rho phase")
    ap.add_argument("--ckpt", action="store_true", help="checkpoint every run and continue unfinished ones")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="passed to train.py")
    ap.add_argument("--per-gpu", type=int, default=8, help="runs sharing one GPU at a time")
    ap.add_argument("--img-dir", default=None,
                    help="also copy the plots here (e.g. docs/img), named after the config: tiny-rho.png")
    ap.add_argument("--summarize", action="store_true", help="only rebuild the report from OUT")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from: " + "; ".join(VARIANTS))
    if args.time_budget is not None and args.time_budget <= 0:
        ap.error(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if not 0 <= args.rho_share < 1:
        ap.error(f"--rho-share must be in [0, 1), got {args.rho_share}")
    return args


def plan(args, cfg: dict) -> dict[str, list[dict]]:
    """Every run of each phase: name, variant, seed, directory and train.py arguments."""
    out = Path(args.out)
    steps = args.steps or cfg["steps"]
    lr = args.lr or cfg["lr"]
    common = [*cfg["model"], "--compile", args.compile, "--corpus-dir", str(out / "corpus")]
    if args.cpu:
        common += ["--threads", "1"]
    runs = {"main": [], "rho": []}
    every = max(cfg["eval_every"], steps // 12)  # a dozen evaluations per curve: evaluating costs training time
    for name in args.variants:
        for seed in args.seeds if name in SEEDED else args.ablation_seeds:
            d = out / "main" / f"{slug(name)}-seed{seed}"
            extra = ["--save-weights", str(d / "final.safetensors")] if name == ADAMW and seed == args.seeds[0] else []
            runs["main"].append({"variant": name, "seed": seed, "dir": d, "steps": steps, "argv": [
                *VARIANTS[name], *common, "--steps", str(steps), "--lr", str(lr), "--warmup", str(max(1, steps // 20)),
                "--eval-every", str(every), "--log-every", str(every), "--seed", str(seed),
                *extra]})
    rho_steps = args.rho_steps or cfg["rho_steps"]
    rho_every = max(cfg["rho_eval_every"], rho_steps // 8)
    init = out / "main" / f"{slug(ADAMW)}-seed{args.seeds[0]}" / "final.safetensors"
    for name in RHO_VARIANTS:
        for seed in args.rho_seeds:
            d = out / "rho" / f"{slug(name)}-seed{seed}"
            runs["rho"].append({"variant": name, "seed": seed, "dir": d, "steps": rho_steps, "init": init, "argv": [
                *VARIANTS[name], *common, "--steps", str(rho_steps), "--lr", str(args.rho_lr or cfg["rho_lr"]),
                "--warmup", "0", "--min-lr-ratio", "1", "--eval-every", str(rho_every),
                "--log-every", str(rho_every), "--seed", str(100 + seed), "--init-from", str(init)]})
    return runs


def finished(run: dict) -> bool:
    summary = run["dir"] / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("steps") == run["steps"]


def launch(runs: list[dict], args, gpus: int, deadline: float | None) -> None:
    """Run every unfinished run of a phase side by side; stop them at ``deadline`` (their --time-limit a little
    before it, a signal at it)."""
    procs = []
    started = time.time()
    for i, run in enumerate(r for r in runs if not finished(r)):
        run["dir"].mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["CUDA_VISIBLE_DEVICES"] = str(i // args.per_gpu % gpus) if gpus else ""
        argv = [*run["argv"], "--out-dir", str(run["dir"])]
        if args.ckpt:
            # a tenth of the run apart (each run also saves when its time limit stops it)
            argv += ["--ckpt-dir", str(run["dir"] / "ckpt"), "--ckpt-every", str(max(100, run["steps"] // 10)),
                     "--auto-resume"]
        if deadline is not None:
            # the margin covers the last evaluation, a checkpoint and writing the weights
            argv += ["--time-limit", f"{max(1.0, deadline - time.time() - 25):.0f}"]
        # the recipe runs the way this file runs (a module of the launch package, or a file)
        recipe = ["-m", f"{__package__}.train"] if __package__ else [str(HERE / "train.py")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *recipe, *argv]
        log = open(run["dir"] / "stdout.log", "a")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                      run))
        print(f"started {run['variant']} seed {run['seed']} -> {run['dir']}", flush=True)
    for proc, run in procs:
        try:
            proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the torchrun agent and its worker
            proc.wait()
            wrote = (run["dir"] / "summary.json").exists() and (run["dir"] / "summary.json").stat().st_mtime > started
            print(f"stopped {run['variant']} seed {run['seed']} at the time budget"
                  + (" while it exited (its summary is written)" if wrote else ""), flush=True)
            continue
        if proc.returncode:
            print(f"{run['variant']} seed {run['seed']} exited with {proc.returncode}: see {run['dir'] / 'stdout.log'}",
                  flush=True)


def read_run(run: dict) -> dict:
    """Status and validation curve of one run, from what it wrote (log.jsonl grows as the run goes)."""
    log_path, summary_path = run["dir"] / "log.jsonl", run["dir"] / "summary.json"
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()] if log_path.exists() else []
    curve = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    moved = [(r["tokens"], r["bf16_moved"]) for r in rows if "bf16_moved" in r]
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    steps = rows[-1]["step"] if rows else 0
    status = "complete" if steps == run["steps"] else ("not started" if not rows else "partial")
    return {"variant": run["variant"], "seed": run["seed"], "dir": str(run["dir"]), "status": status, "steps": steps,
            "planned_steps": run["steps"], "tokens": rows[-1]["tokens"] if rows else 0, "val_curve": curve,
            "bf16_moved": moved, "tokens_per_s": summary.get("tokens_per_s") if summary.get("steps") == steps else None,
            "params": summary.get("params")}


def phase_stats(results: list[dict]) -> dict:
    """Per-variant validation loss at the last evaluation every run of the phase reached (so partial runs compare
    at equal tokens), its mean and seed spread, the gap to its reference (AdamW, or torch Muon for the Muon
    variants; paired by seed: the mean over the seeds both ran of variant minus reference, in units of the pooled
    seed sd, and of variant over reference in %), and the gain from the starting weights."""
    curves = [dict(r["val_curve"]) for r in results if r["val_curve"]]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    at = common[-1] if common else None  # None: no evaluation in common, each run's last one is used

    def value(r: dict) -> float:
        return dict(r["val_curve"])[at] if at is not None else r["val_curve"][-1][1]

    by_variant: dict[str, list[float]] = {}
    gains: dict[str, list[float]] = {}  # from the starting weights (the rho phase evaluates them at 0 tokens)
    for r in results:
        if r["val_curve"]:
            by_variant.setdefault(r["variant"], []).append(value(r))
            if r["val_curve"][0][0] == 0:
                gains.setdefault(r["variant"], []).append(r["val_curve"][0][1] - value(r))
    # pooled within-variant sd over the variants with two seeds or more: the seed-to-seed noise of one run
    dev = [(v - statistics.mean(vals)) ** 2 for vals in by_variant.values() if len(vals) > 1 for v in vals]
    dof = sum(len(vals) - 1 for vals in by_variant.values() if len(vals) > 1)
    seed_sd = (sum(dev) / dof) ** 0.5 if dof else None
    rows = []
    for name, vals in by_variant.items():
        mean = statistics.mean(vals)
        ref = {r["seed"]: value(r) for r in results if r["variant"] == REFERENCE[name] and r["val_curve"]}
        # paired by seed (same initialisation and data order): a one-seed ablation meets its reference's run of
        # that seed
        paired = [(value(r), ref[r["seed"]]) for r in results
                  if r["variant"] == name and r["val_curve"] and r["seed"] in ref]
        gap = statistics.mean(v - a for v, a in paired) if paired else None
        rows.append({"variant": name, "val_losses": vals, "mean": mean, "range": max(vals) - min(vals),
                     "gap": gap, "gap_pct": statistics.mean(100 * (v / a - 1) for v, a in paired) if paired else None,
                     "gap_in_seed_sd": None if gap is None or not seed_sd else gap / seed_sd,
                     "gain_from_start": statistics.mean(gains[name]) if name in gains else None})
    return {"at_tokens": at, "seed_sd": seed_sd, "rows": rows}


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(stats: dict) -> list[str]:
    where = (f"at {stats['at_tokens']:,} tokens per run" if stats["at_tokens"] is not None else
             "at each run's last evaluation (the runs share none: compare with care)")
    lines = [f"validation loss (nats/byte) {where}; pooled seed sd "
             f"{_fmt(stats['seed_sd'], '.4f')}", "",
             "| variant | val loss per seed | mean | range | vs reference | gap / seed sd | gain from the start |",
             "|---|---|---|---|---|---|---|"]
    if any("Muon" in r["variant"] for r in stats["rows"]):
        lines.insert(1, "reference: torch Muon for the Muon rows, AdamW for the others")
    for r in stats["rows"]:
        lines.append(f"| {r['variant']} | {' / '.join(f'{v:.4f}' for v in r['val_losses'])} | {r['mean']:.4f} | "
                     f"{r['range']:.4f} | {_fmt(r['gap_pct'], '+.2f')}% | {_fmt(r['gap_in_seed_sd'], '+.1f')} | "
                     f"{_fmt(r['gain_from_start'], '.4f')} |")
    return lines


def plot(results: list[dict], path: Path, title: str, moved: bool) -> bool:
    """Validation loss against tokens, one line per variant (the mean over seeds) in a band from the lowest to
    the highest seed. A second panel: with ``moved``, the share of bf16 weights an optimizer step changes; without,
    each variant's loss relative to AdamW's run of the same seed (in %), where gaps of a fraction of a percent,
    invisible on the loss curves, show; a variant far off (more than 20% at the end) leaves its scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curve_of = {(r["variant"], r["seed"]): dict(r["val_curve"]) for r in results if r["val_curve"]}
    keys = ["val_curve", "bf16_moved" if moved else "vs_adamw"]
    if not moved and not any(v in (ADAMW, MUON) for v, _ in curve_of):
        keys = keys[:1]
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.2), squeeze=False)
    finals = []  # the gaps at the end that set the relative panel's scale
    for key, ax in zip(keys, axes[0]):
        for name in dict.fromkeys(r["variant"] for r in results):
            if key == "vs_adamw":
                ref = {seed: c for (v, seed), c in curve_of.items() if v == REFERENCE[name]}
                curves = [{x: 100 * (v / ref[r["seed"]][x] - 1) for x, v in r["val_curve"] if x in ref[r["seed"]]}
                          for r in results if r["variant"] == name and r["seed"] in ref]
                curves = [c for c in curves if c]
            else:
                curves = [dict(r[key]) for r in results if r["variant"] == name and r[key]]
            if not curves:
                continue
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            ys = [[c[x] for c in curves] for x in xs]
            line, = ax.plot(xs, [statistics.mean(y) for y in ys], marker=".", label=f"{name} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
            if key == "vs_adamw" and xs and abs(statistics.mean(ys[-1])) < 20:
                finals += [v for y in ys[len(ys) // 2:] for v in y]
        ax.set_xlabel("tokens (bytes) per run")
        ax.set_ylabel({"val_curve": "validation loss (nats/byte)", "bf16_moved": "share of bf16 weights moved by a step",
                       "vs_adamw": "val loss vs AdamW (Muon rows: torch Muon), %"}[key])
        if key == "bf16_moved":
            ax.set_yscale("log")
        if key == "vs_adamw" and finals:
            span = max(1.0, *(abs(v) for v in finals))
            ax.set_ylim(-1.3 * span, 1.3 * span)
            ax.axhline(0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title, fontsize=10)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarize(runs: dict[str, list[dict]], args, meta: dict) -> dict:
    out = Path(args.out)
    report = {"meta": meta, "phases": {}}
    md = [f"# Convergence runs: {meta['config']} on {meta['device']} ({meta['date']})", ""]
    corpus = sorted((out / "corpus").glob("*/manifest.json"))
    if corpus:
        shutil.copy(corpus[-1], out / "corpus.json")
        c = json.loads(corpus[-1].read_text())
        md += [f"Corpus: {c['train_files']:,} training files ({c['train_bytes'] / 2**20:.0f} MiB), {c['val_files']:,} "
               f"validation files ({c['val_bytes'] / 2**20:.1f} MiB); listing sha256 {c['listing_sha256'][:16]}", ""]
    for phase in ("main", "rho"):
        results = [read_run(r) for r in runs[phase]]
        if not any(r["val_curve"] for r in results):
            continue
        stats = phase_stats(results)
        report["phases"][phase] = {"runs": results, **stats}
        title = {"main": "main phase: pre-training from scratch",
                 "rho": "rho phase: fine-tuning at a small learning rate from AdamW's weights"}[phase]
        md += [f"## {title}", "", *table(stats), ""]
        partial = [f"{r['variant']} seed {r['seed']} ({r['status']}: {r['steps']}/{r['planned_steps']} steps)"
                   for r in results if r["status"] != "complete"]
        md += ["Runs: " + ", ".join(f"{r['variant']} seed {r['seed']} {r['tokens']:,} tokens"
                                    + (f" at {r['tokens_per_s']:,.0f} tok/s" if r["tokens_per_s"] else "")
                                    for r in results) + ".",
               "", "Partial: " + ("; ".join(partial) if partial else "none") + ".", ""]
        png = out / ("convergence.png" if phase == "main" else "rho.png")
        if plot(results, png, f"{meta['config']}: {title}", moved=phase == "rho") and args.img_dir:
            Path(args.img_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(png, Path(args.img_dir) / f"{meta['config']}-{png.name}")  # e.g. tiny-rho.png
    md += ["What the evidence supports: (to be written from the tables above)", ""]
    (out / "convergence.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "convergence.md").write_text("\n".join(md))
    print("\n".join(md), flush=True)
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.time_budget if args.time_budget else None
    import torch

    gpus = 0 if args.cpu else torch.cuda.device_count()
    args.cpu = not gpus
    config = args.config or ("gpt2-small" if gpus else "tiny")
    cfg = CONFIGS[config]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = plan(args, cfg)
    meta = {"config": config, "model_args": cfg["model"], "device": torch.cuda.get_device_name() if gpus else "cpu",
            "gpus": gpus, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    if not args.summarize:
        if "--corpus-mb" not in cfg["model"]:  # build the corpus once, before the runs map it
            if __package__:  # python -m launch.convergence
                from .data import build_corpus
            else:  # run as a file: launch/ is the script's directory, first on sys.path
                from data import build_corpus

            where = build_corpus(out / "corpus")
            print(f"corpus: {where} ({time.time() - t0:.0f} s)", flush=True)
        if "main" in args.phases:
            end = None if deadline is None else deadline - (args.rho_share * args.time_budget
                                                             if "rho" in args.phases else 0) - 10
            launch(runs["main"], args, gpus, end)
        if "rho" in args.phases:
            init = runs["rho"][0]["init"]
            left = None if deadline is None else deadline - 10 - time.time()
            if not init.exists():
                print(f"rho phase skipped: {init} is missing (the main phase's AdamW run did not get there)")
            elif args.ckpt and not all(finished(r) for r in runs["main"]):
                print("rho phase not started: it fine-tunes the final AdamW weights, and the main phase is unfinished")
            elif left is not None and left < 90:
                print(f"rho phase not started: {left:.0f} s left is too little")
            else:
                launch(runs["rho"], args, gpus, None if deadline is None else deadline - 10)
        meta["wall_s"] = round(time.time() - t0)
    return summarize(runs, args, meta)


if __name__ == "__main__":
    main()
