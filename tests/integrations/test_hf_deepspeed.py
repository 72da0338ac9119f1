"""DeepSpeed reached through Accelerate and the Transformers Trainer, on CPU (DS_ACCELERATOR=cpu, gloo, no
DeepSpeed op built): a flashdist optimizer gets ZeRO's flat partitions in the flat 8-bit layout, or the run is
refused with the fix; never silently fp32 moments."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from flashdist import FlashAdamW
from flashdist._compat import HAS_DEEPSPEED
from flashdist.integrations import deepspeed as fds

from harness import run_ranks
from _tiny_llama import tiny_llama  # tests/integrations/_tiny_llama.py

needs_stack = pytest.mark.skipif(
    not HAS_DEEPSPEED or any(importlib.util.find_spec(m) is None for m in ("accelerate", "transformers")),
    reason="needs deepspeed, accelerate and transformers (launch/setup.sh installs them)")


def _config(**overrides):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    config.update(overrides)
    return config


def test_bf16_masters_with_bf16_disabled_are_refused():
    """bf16_master_weights_and_grads with bf16.enabled false would train the fp32 model with 16-bit masters."""
    for bf16 in ({"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}):
        config = _config(bf16=bf16, optimizer={"type": "FlashAdamW", "params": {"lr": 1e-3}})
        with pytest.raises(ValueError, match="bf16.enabled is false.*Set bf16.enabled: true"):
            fds.prepare_config(config)
    ok = _config(bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                 optimizer={"type": "FlashAdamW"})
    assert fds.prepare_config(ok)[1].cls is FlashAdamW


# ----- on a gloo rank -------------------------------------------------------------------------------------


def _setup():
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0")
    from collections import defaultdict

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = defaultdict(bool)  # nothing JIT-builds (see tests/test_deepspeed.py)


def _batch(step: int):
    ids = (torch.randint(0, 128, (4, 1), generator=torch.Generator().manual_seed(step)) + torch.arange(16)) % 128
    return {"input_ids": ids, "labels": ids}


def _flat_state(optimizer) -> dict:
    """What the flashdist optimizer under the engine holds: layout, moment dtypes, partition shapes."""
    return {"flat_layout": [g["flat_layout"] for g in optimizer.param_groups],
            "codes": sorted({str(s["exp_avg_codes"].dtype) for s in optimizer.state.values()}),
            "float_moments": any("exp_avg" in s for s in optimizer.state.values()),
            "partitions_1d": all(p.dim() == 1 for p in optimizer.state)}


def _accelerate(config: dict, optimizer_of) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = tiny_llama()
    engine, optimizer = accelerator.prepare(model, optimizer_of(model))
    losses = []
    for step in range(3):
        loss = engine(**_batch(step)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "type": type(engine.basic_optimizer).__name__, **_flat_state(engine.basic_optimizer)}


def _trainer(out_dir: str, config: dict, optimizers_of=None, **args) -> dict:
    import transformers
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    rows = [{"input_ids": b, "labels": b} for step in range(3) for b in _batch(step)["input_ids"]]
    args = transformers.TrainingArguments(output_dir=out_dir, deepspeed=config, max_steps=3, learning_rate=1e-2,
                                          per_device_train_batch_size=4, logging_steps=1, report_to=[],
                                          disable_tqdm=True, save_strategy="no", **args)
    # fp32: the Trainer's bf16 needs a GPU or use_cpu, and use_cpu turns DeepSpeed off
    model = tiny_llama(torch.float32)
    optimizers = optimizers_of(model) if optimizers_of else (None, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, optimizers=optimizers)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    basic = trainer.model_wrapped.basic_optimizer
    if not isinstance(basic, FlashAdamW):
        return {"type": type(basic).__name__}
    return {"losses": losses, "type": type(basic).__name__, **_flat_state(basic)}


def _rank_routes(rank: int, world: int, out_dir: str) -> dict:
    _setup()
    import deepspeed

    from flashdist.integrations import transformers as fd_hf

    results = {}
    try:  # before any register(): the optimizer itself refuses ZeRO's flat partitions in a row-layout group
        _accelerate(_config(), lambda m: FlashAdamW(m.parameters(), lr=1e-2))
    except ValueError as e:
        results["unregistered-row-layout-instance"] = str(e)
    original = deepspeed.initialize
    fd_hf.register()  # registers flashdist.integrations.deepspeed too
    routed = deepspeed.initialize
    fds.register()  # idempotent
    results.update(routed=routed is not original and routed.__wrapped__ is original,
                   routed_once=deepspeed.initialize is routed)
    from accelerate.utils import DummyOptim

    named = _config(optimizer={"type": "FlashAdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}})
    results["accelerate-config"] = _accelerate(named, lambda m: DummyOptim(m.parameters()))
    results["accelerate-instance"] = _accelerate(
        _config(), lambda m: FlashAdamW(m.parameters(), lr=1e-2, flat_layout=True))
    try:
        _accelerate(_config(), lambda m: FlashAdamW(m.parameters(), lr=1e-2))
    except ValueError as e:
        results["accelerate-row-layout-instance"] = str(e)
    try:
        _accelerate(_config(bf16={"enabled": False, "bf16_master_weights_and_grads": True,
                                  "bf16_optimizer_states": True}),
                    lambda m: FlashAdamW(m.parameters(), lr=1e-2, flat_layout=True))
    except ValueError as e:
        results["accelerate-bf16-masters-without-bf16"] = str(e)
    results["trainer-optim"] = _trainer(os.path.join(out_dir, "a"), _config(bf16={"enabled": False}),
                                        optim="flash_adamw", optim_args="master_weight_bits=24")
    # Transformers' deepspeed_init drops an optimizers=(...) instance and builds args.optim (docs/integrations.md)
    results["trainer-instance"] = _trainer(os.path.join(out_dir, "c"), _config(bf16={"enabled": False}),
                                           optimizers_of=lambda m: (FlashAdamW(m.parameters(), lr=1e-2), None))
    auto = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    results["trainer-config"] = _trainer(os.path.join(out_dir, "b"), _config(
        optimizer={"type": "FlashAdamW", "params": auto}, train_micro_batch_size_per_gpu="auto",
        gradient_accumulation_steps="auto", bf16={"enabled": "auto"}))
    return results


@needs_stack
def test_deepspeed_through_accelerate(tmp_path):
    results = run_ranks(_rank_routes, 1, str(tmp_path), timeout=600)[0]
    for key in ("accelerate-config", "accelerate-instance", "trainer-optim", "trainer-config"):
        run = results[key]
        assert run["type"] == "FlashAdamW" and run["flat_layout"] and all(run["flat_layout"]), (key, run)
        assert run["codes"] == ["torch.int8"] and not run["float_moments"] and run["partitions_1d"], (key, run)
        assert run["losses"][-1] < run["losses"][0], (key, run)
    assert results["routed"] and results["routed_once"]
    message = results["accelerate-row-layout-instance"]
    assert "ZeRO swaps its parameters for flat partitions" in message and "flat_layout=True" in message
    message = results["unregistered-row-layout-instance"]
    assert "a plain 1-d tensor" in message and "flat_layout=True" in message
    assert results["trainer-instance"]["type"] == "AdamW"
    assert "bf16.enabled is false" in results["accelerate-bf16-masters-without-bf16"]
