"""Print the main job's summary from the summary.json files that launch/train.py writes."""

from __future__ import annotations

import json
import sys


def main(flash_path: str, adamw_path: str) -> None:
    flash, adamw = (json.load(open(p)) for p in (flash_path, adamw_path))
    mf, ma = flash["memory_report"], adamw["memory_report"]
    print("\n== Summary")
    print(f"model: byte-level GPT, {flash['params']:,} parameters; {flash['world_size']} ranks (FSDP2) on "
          f"{flash['device']}; corpus: {flash['corpus']['train_files']} Python source files "
          f"({flash['corpus']['train_bytes'] / 2**20:.1f} MiB train, {flash['corpus']['val_bytes'] / 2**20:.1f} MiB val)")
    print()
    print("| bytes per parameter, measured on rank 0 | FlashAdamW (24-bit) | torch.optim.AdamW (fp32 master) |")
    print("|---|---|---|")
    for key in ("params", "grads", "rho", "codes", "scales", "fp32_moments"):
        print(f"| {key} | {mf[key] / mf['numel']:.3f} | {ma[key] / ma['numel']:.3f} |")
    print(f"| **total** | **{mf['bytes_per_param']:.3f}** | **{ma['bytes_per_param']:.3f}** |")
    print()
    print(f"FlashAdamW: steps {flash['resumed_from']} -> {flash['steps']} after resuming; final train loss "
          f"{flash['final_train_loss']:.4f}, validation loss {flash['final_val_loss']:.4f} nats/byte; "
          f"{flash['tokens_per_s']:,.0f} tokens/s")
    print(f"checkpoint: {flash['checkpoint']}")
    print(f"loss curve: {flash.get('plot') or flash_path.replace('summary.json', 'loss.png')}")
    print(f"logs: {flash_path.replace('summary.json', 'log.jsonl')}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
