"""Bytes per parameter that each client of docs/integrations.md reaches, measured with flashdist.memory_report.

Builds a tiny Llama (transformers' LlamaConfig, no download) for each recipe, trains two steps the way the
recipe does, and measures the real tensors right after the second optimizer step (gradients still present):
parameters, gradients, rho, 8-bit codes and scales, any fp32 moments. One process on CPU; the FSDP2 and
DeepSpeed cases run in a one-rank gloo group (DS_ACCELERATOR=cpu, no DeepSpeed op built). Prints a table and
writes JSON.

    python launch/bench/bench_integrations.py --out runs/integrations_memory.json
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

import flashdist
from flashdist import FlashAdamW

KEYS = ("params", "grads", "rho", "codes", "scales", "fp32_moments", "other")


def _llama(dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _batch(step: int) -> dict:
    ids = (torch.randint(0, 128, (4, 1), generator=torch.Generator().manual_seed(step)) + torch.arange(16)) % 128
    return {"input_ids": ids, "labels": ids}


def _per_param(report: dict) -> dict:
    n = report["numel"]
    return {**{k: report[k] / n for k in KEYS}, "total": report["total"] / n, "numel": n}


# ----- Transformers Trainer ----------------------------------------------------------------------------


def trainer(dtype: torch.dtype, route: str) -> dict:
    import transformers

    from flashdist.integrations import transformers as fd_hf

    fd_hf.register(deepspeed=False)
    measured = {}

    class Measure(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            if state.global_step == 1:  # the second step (global_step counts finished ones); grads still held
                opt = getattr(optimizer, "optimizer", optimizer)
                measured.update(flashdist.memory_report(opt))

    rows = [{"input_ids": b, "labels": b} for step in range(2) for b in _batch(step)["input_ids"]]
    model = _llama(dtype)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, optim="flash_adamw" if route == "optim" else "adamw_torch", max_steps=2,
            per_device_train_batch_size=4, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
        optimizers = (FlashAdamW(model.parameters(), lr=1e-3), None) if route == "optimizers" else (None, None)
        transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=optimizers,
                             callbacks=[Measure()]).train()
    return measured


# ----- Accelerate, one process -------------------------------------------------------------------------


def accelerate_single() -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    return _two_prepared_steps(accelerator)


def _two_prepared_steps(accelerator) -> dict:
    """A bf16 tiny Llama and a FlashAdamW through ``accelerator.prepare``, two steps; the memory report taken
    while the gradients are still held."""
    model = _llama(torch.bfloat16)
    model, optimizer = accelerator.prepare(model, FlashAdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        accelerator.backward(model(**_batch(step)).loss)
        optimizer.step()
        report = flashdist.memory_report(optimizer.optimizer)
        optimizer.zero_grad()
    return report


# ----- torchrun + FSDP2 (fully_shard), one rank ----------------------------------------------------------


def fsdp2() -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _llama(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = FlashAdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        model(**_batch(step)).loss.backward()
        optimizer.step()
        report = flashdist.memory_report(optimizer)
        optimizer.zero_grad()
    return report


# ----- Accelerate FSDP2, one rank -----------------------------------------------------------------------


def accelerate_fsdp2(mixed_precision: str) -> dict:
    """Accelerate's own FSDP2 prepare. Accelerate enables FSDP only for GPU-class distributed types, so on CPU
    its shared state is set to FSDP + an FSDP2 plugin, as a GPU launch would have it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    return _two_prepared_steps(accelerator)


# ----- DeepSpeed ZeRO-2 through Accelerate, one rank ---------------------------------------------------


def deepspeed_accelerate(bf16_masters: bool) -> dict:
    """The optimizer's partitions and state (memory_report of engine.basic_optimizer) plus the engine's bf16
    model weights; DeepSpeed's gradient buckets are not counted."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    from flashdist.integrations import deepspeed as fds

    fds.register()
    AcceleratorState._reset_state(True)
    bf16 = {"enabled": True}
    if bf16_masters:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 2}, "bf16": bf16,
              "optimizer": {"type": "FlashAdamW", "params": {"lr": 1e-3}}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _llama(torch.bfloat16)
    engine, optimizer = accelerator.prepare(model, DummyOptim(model.parameters()))
    for step in range(2):
        accelerator.backward(engine(**_batch(step)).loss)
        optimizer.step()
        optimizer.zero_grad()
    report = flashdist.memory_report(engine.basic_optimizer, include_grads=False)
    model_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    report["other"] += model_bytes  # the model's own bf16 weights, beside the master partitions
    report["total"] = sum(report[k] for k in KEYS)
    return report


CASES = {
    "Trainer, optim=\"flash_adamw\", bf16 model": lambda: trainer(torch.bfloat16, "optim"),
    "Trainer, optimizers=(FlashAdamW, None), bf16 model": lambda: trainer(torch.bfloat16, "optimizers"),
    "Trainer, optim=\"flash_adamw\", fp32 model": lambda: trainer(torch.float32, "optim"),
    "Accelerate, one process, bf16 model": accelerate_single,
    "torchrun FSDP2 (fully_shard), bf16 model": fsdp2,
    "Accelerate FSDP2, mixed_precision=\"no\", bf16 model": lambda: accelerate_fsdp2("no"),
    "Accelerate FSDP2, mixed_precision=\"bf16\" (upcasts to fp32)": lambda: accelerate_fsdp2("bf16"),
    "DeepSpeed ZeRO-2 via Accelerate, fp32 master partitions": lambda: deepspeed_accelerate(False),
    "DeepSpeed ZeRO-2 via Accelerate, bf16 masters + rho": lambda: deepspeed_accelerate(True),
}
DISTRIBUTED = ("torchrun", "Accelerate FSDP2", "DeepSpeed")


def _init_one_rank_group() -> None:
    import torch.distributed as dist
    from collections import defaultdict

    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = defaultdict(bool)  # gloo is enough: build no DeepSpeed C++ op
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    parser.add_argument("--cases", nargs="*", default=None, help="substrings of the case names to run")
    ns = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = {}
    grouped = False
    for name, run in CASES.items():
        if ns.cases and not any(c.lower() in name.lower() for c in ns.cases):
            continue
        if name.startswith(DISTRIBUTED) and not grouped:  # after the Trainer cases: they must see no group
            _init_one_rank_group()
            grouped = True
        rows[name] = _per_param(run())
    header = f"{'case':58s} " + " ".join(f"{k:>8s}" for k in (*KEYS, "total"))
    print(header)
    for name, r in rows.items():
        print(f"{name:58s} " + " ".join(f"{r[k]:8.3f}" for k in (*KEYS, "total")))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "torch": torch.__version__, "unit": "bytes per parameter", "cases": rows}
        Path(ns.out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
