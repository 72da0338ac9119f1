"""``flashdist``: inspect, convert, export and clean sharded checkpoints. A thin layer over flashdist.checkpoint.convert.

Exit status 0 on success; 1 with a one-line reason on stderr otherwise. Outputs are written one tensor at a
time to a temporary name and renamed into place; an existing output is replaced only with --force, and only
when it is a previous output of the same kind. ``clean`` removes what killed runs left beside a path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

EXAMPLES = {
    "inspect": ("examples:\n  flashdist inspect runs/main/ckpt/latest\n  flashdist inspect model.pt --json\n"
                "  flashdist inspect runs/ds/ckpt                 # a DeepSpeed folder (its latest tag)"),
    "convert": ("examples:\n"
                "  flashdist convert runs/ckpt/latest ckpt.pt --to torch              # DCP (any world size) -> one file\n"
                "  flashdist convert ckpt.pt ckpt_dcp --to dcp --format compressed    # -> DCP, 8-bit optimizer state\n"
                "  flashdist convert ckpt.safetensors ckpt_dcp --to dcp              # one file -> DCP\n"
                "  flashdist convert runs/ds/ckpt ckpt_dcp --from deepspeed --to dcp  # DeepSpeed ZeRO 1/2/3 -> DCP "
                "for FSDP2\n"
                "  flashdist convert runs/ds/ckpt ckpt_dcp --from deepspeed --to dcp --tag step100 "
                "--master-weight-bits 32\n"
                "  flashdist convert flashoptim.pt ckpt_dcp --from flashoptim --to dcp  # torch.save({'model': ..., "
                "'optimizer': ...}) of flashoptim's FlashAdamW"),
    "clean": ("examples:\n  flashdist clean runs/main/ckpt/latest --dry-run   # list only\n"
              "  flashdist clean runs/main/ckpt/latest\n  flashdist clean model.safetensors"),
    "export": ("examples:\n  flashdist export runs/main/ckpt/latest model.safetensors\n"
               "  flashdist export runs/main/ckpt/latest hf_model --hf --config config.json --dtype bf16 "
               "--max-shard-size 2GB\n"
               "      # a folder transformers' from_pretrained('hf_model') loads\n"
               "  flashdist export out/checkpoint-500 hf_model --hf --config out/checkpoint-500/config.json"
               "  # a Trainer checkpoint"),
}


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self):
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(f"\r{what:>16} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashdist", description="Inspect, convert and export flashdist checkpoints "
                                 "(DCP directories, torch files, safetensors files, DeepSpeed ZeRO directories, "
                                 "Hugging Face Trainer checkpoint-N folders).")
    sub = ap.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("inspect", help="what a checkpoint is", epilog=EXAMPLES["inspect"], formatter_class=fmt,
                       description="Kind, optimizer-state format and version, saved world size, parameter count, "
                                   "dtypes, master_weight_bits, the masters an export gives (how many weights get "
                                   "their rho and how the optimizer state was named, or why export refuses), step "
                                   "and bytes on disk per parameter. Reads metadata only where the format allows.")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p = sub.add_parser("convert", help="convert between formats", epilog=EXAMPLES["convert"], formatter_class=fmt,
                       description="Read SRC (DCP directory of any world size, torch file, safetensors file, or "
                                   "the folder of a DeepSpeed ZeRO 1/2/3 checkpoint saved with a flashdist "
                                   "optimizer) and write DST, one tensor at a time. DST is written under a temporary "
                                   "name beside it and renamed when complete; a failure leaves nothing. DST may not be "
                                   "SRC, lie inside it or hold it. "
                                   "A DeepSpeed checkpoint becomes the checkpoint FSDP2 + the same flashdist optimizer "
                                   "resume from (flashdist.checkpoint.load, any world size): parameters in the model's "
                                   "dtype with rho (the 24-bit master weights; bf16-master runs exactly), the portable "
                                   "optimizer state keyed by parameter name. Every rank's files must be there.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["dcp", "torch", "safetensors"], help="output format")
    p.add_argument("--format", choices=["portable", "compressed"], default=None,
                   help="switch the optimizer-state format (compressed -> portable dequantizes; portable -> "
                        "compressed quantizes row-aligned, loadable by FSDP2 at any world size)")
    p.add_argument("--from", dest="src_kind", choices=["auto", "deepspeed", "flashoptim"], default="auto",
                   help="input kind (default: detected; deepspeed: fail unless SRC is a DeepSpeed folder; "
                        "flashoptim: fail unless SRC is a torch file of flashoptim's model + FlashAdamW state dicts)")
    p.add_argument("--tag", default=None, help="DeepSpeed: the checkpoint tag (default: SRC/latest)")
    p.add_argument("--master-weight-bits", type=int, choices=[24, 32], default=None,
                   help="DeepSpeed, flashoptim: rho of the output, 24 (int8) or 32 (int16: fp32 masters kept exactly); "
                        "default: the checkpoint's optimizer setting. Build the loading FlashAdamW with the same")
    p.add_argument("--force", action="store_true",
                   help="replace DST if it is a previous output of the same kind (never a folder holding other files)")
    p = sub.add_parser("export", help="master weights as safetensors or a Hugging Face model folder",
                       epilog=EXAMPLES["export"], formatter_class=fmt,
                       description="Write the master weights (bf16/fp16 parameter + rho; a tied parameter under each "
                                   "of its names) of CKPT (DCP, torch, safetensors, DeepSpeed ZeRO folder, "
                                   "flashoptim file or Trainer checkpoint-N folder), keyed by the model's FQNs, for "
                                   "inference: one safetensors file, or with --hf a Hugging Face model folder "
                                   "(size-capped safetensors shards, model.safetensors.index.json, config.json) that "
                                   "from_pretrained loads. Optimizer state keyed by index (torch.save of "
                                   "opt.state_dict(), a Trainer's optimizer.pt) is named by its param_names, else by "
                                   "the model's parameter order where only one match exists; otherwise, and for a "
                                   "rho no weight uses, export refuses.")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--hf", action="store_true", help="write a Hugging Face model folder OUT")
    p.add_argument("--config", default=None,
                   help="--hf: the model's config.json (model.config.save_pretrained writes it), copied into OUT")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32: the master weights (default); bf16: rounded to nearest (half the size)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--hf: largest shard file, bytes or e.g. 5GB, 500MB (default 5GB; a larger tensor gets a shard "
                        "of its own)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it is a previous output of the same kind (never a folder holding other files)")
    p = sub.add_parser("clean", help="remove what killed saves, converts and exports left beside a path",
                       epilog=EXAMPLES["clean"], formatter_class=fmt,
                       description="List and remove the leftovers of killed runs writing PATH: temporary folders of "
                                   "saves (PATH.tmp-<id>), temporary outputs of convert/export (.PATH.<random>.tmp), "
                                   "and a previous checkpoint or output moved aside (PATH.old, .PATH.<random>.old), "
                                   "which is put back at PATH when PATH is missing. Only what no live run holds "
                                   "(its lock is free) and whose files are recognisably flashdist's is touched; "
                                   "anything else is listed as kept, with the reason.")
    p.add_argument("path")
    p.add_argument("--dry-run", action="store_true", help="list only; change nothing")
    _add_plan_parser(sub, fmt)
    return ap


def _add_plan_parser(sub, fmt) -> None:
    from .memory_plan import FAMILIES, MODES, PRESETS

    p = sub.add_parser(
        "plan", help="will a model fit: per-GPU memory with flashdist and with AdamW", formatter_class=fmt,
        description="Per-GPU memory of each part (weights, gradients, optimizer state, FSDP2 buffers, activations) "
                    "with FlashAdamW and with torch's AdamW (fp32 master), whether it fits, and the largest batch "
                    "per GPU that would. The formulas: flashdist.memory_plan's docstring (docs/scaling.md).",
        epilog="examples:\n  flashdist plan llama-3.1-8b --gpus 8 --gpu-memory 80\n"
               "  flashdist plan llama-3.1-70b --gpus 64 --mode hsdp --gradient-release --recompute 80\n"
               "  flashdist plan path/to/config.json --gpus 1 --gpu-memory 24 --offload\n"
               "  flashdist plan --params 3e9 --gpus 4 --mode zero2 --json\n"
               "  flashdist plan llama-3.1-8b --gpus 1 --gpu-memory 141 --optimizer muon")
    p.add_argument("model", nargs="?", help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json")
    p.add_argument("--params", type=float, help="a parameter count instead of a model (no activations then)")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="HSDP shards over one node's GPUs (default 8)")
    p.add_argument("--mode", choices=MODES, default="fsdp2", help="how the model is sharded (default fsdp2)")
    p.add_argument("--offload", action="store_true", help="optimizer state and master weights in host memory")
    p.add_argument("--gradient-release", action="store_true", help="flashdist steps in backward: no gradients held")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU (default 1)")
    p.add_argument("--recompute", type=int, default=0, help="decoder layers with activation checkpointing")
    p.add_argument("--optimizer", choices=FAMILIES, default="adamw",
                   help="adamw: FlashAdamW against torch's AdamW (default); muon: FlashMuon against "
                        "torch.optim.Muon, the embedding, head and norms taking AdamW in both")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def _plan(args) -> int:
    from .memory_plan import format_plan, plan

    if (args.model is None) == (args.params is None):
        print("flashdist plan: give a model (a preset or a config.json) or --params N, not both", file=sys.stderr)
        return 1
    try:
        result = plan(model=args.model, params=args.params, gpus=args.gpus, gpu_memory_gib=args.gpu_memory,
                      mode=args.mode, gpus_per_node=args.gpus_per_node, offload=args.offload,
                      gradient_release=args.gradient_release, seq=args.seq, batch=args.batch,
                      recomputed=args.recompute, optimizer=args.optimizer)
    except ValueError as e:
        print(f"flashdist plan: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0


def _print_inspect(info: dict) -> None:
    kind = info["kind"] + (f" (ZeRO-{info['zero_stage']}, {info['deepspeed_masters']} master partitions)"
                           if info.get("zero_stage") else f" ({info['layout']})" if info.get("layout") else "")
    rows = [("path", info["path"]), ("kind", kind),
            ("saved world size", info.get("saved_world_size") or "-"),
            ("parameters", f"{info['parameters']:,} in {info['parameter_tensors']} tensors"),
            ("model dtypes", ", ".join(f"{k} ({v:,})" for k, v in info["model_dtypes"].items()) or "-"),
            ("optimizer state", f"{info['optimizer_format'] or '-'} (version {info.get('format_version') or '-'})"),
            ("master_weight_bits", ", ".join(map(str, info.get("master_weight_bits") or [])) or "-"),
            ("masters", info.get("masters") or "-"),
            ("step", info.get("step", "-")),
            ("bytes on disk", f"{info['bytes_on_disk']:,} ({info['bytes_per_param']:.3f} per parameter)"
             if info.get("bytes_per_param") else f"{info['bytes_on_disk']:,}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from .checkpoint import convert as C
    from .checkpoint.dcp import CheckpointError, error_summary

    progress = _Progress()
    try:
        if args.command == "inspect":
            info = C.inspect(args.path)
            print(json.dumps(info, indent=1, default=str)) if args.json else _print_inspect(info)
        elif args.command == "clean":
            from .checkpoint.clean import clean

            found = clean(args.path, dry_run=args.dry_run)
            for item in found:
                print(item.line(args.dry_run))
            if not found:
                print(f"nothing to clean beside {args.path}")
        elif args.command == "convert":
            if args.src_kind == "deepspeed" and C.detect(args.src) != "deepspeed":
                raise CheckpointError(f"flashdist: {args.src} is not a DeepSpeed checkpoint directory")
            if args.src_kind == "flashoptim" and C.detect(args.src) != "flashoptim":
                raise CheckpointError(f"flashdist: {args.src} is not a flashoptim checkpoint (a torch file of "
                                      "{'model': model.state_dict(), 'optimizer': optimizer.state_dict()} whose "
                                      "param groups carry flashoptim's master_bytewidth)")
            out = C.convert(args.src, args.dst, to=args.to, fmt=args.format, force=args.force, progress=progress,
                            tag=args.tag, master_weight_bits=args.master_weight_bits)
            print(f"wrote {out}")
        else:
            out = C.export(args.ckpt, args.out, force=args.force, progress=progress, hf=args.hf, dtype=args.dtype,
                           config=args.config, max_shard_size=args.max_shard_size)
            print(f"wrote {out}")
    except (CheckpointError, OSError, ImportError) as e:
        print(f"flashdist {args.command}: {error_summary(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a failure nobody foresaw is still one line; the traceback on request
        if os.environ.get("FLASHDIST_TRACEBACK"):
            raise
        print(f"flashdist {args.command}: {type(e).__name__}: {error_summary(e)} (set FLASHDIST_TRACEBACK=1 for the "
              "traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
