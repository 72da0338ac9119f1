"""Trainer + FSDP2 with optim="flash_adamw" on 2 gloo ranks: the Trainer builds the optimizer on the unsharded
bf16 model, Accelerate's FSDP2 prepare shards the model and swaps the optimizer's param_groups for DTensors,
the state follows (8-bit codes, rho, sharded like the parameters) and the weights equal one process bit for bit.

Accelerate turns FSDP on only for GPU-class distributed types (accelerate/state.py: a CPU launch is
MULTI_CPU and its launcher refuses --cpu with FSDP), so on CPU the test sets Accelerate's shared state to
FSDP + an FSDP2 plugin after the Trainer made its Accelerator, as a GPU launch would have it (the same set-up as
tests/distributed/test_accelerate_fsdp2.py). Everything after that, the Trainer's create_optimizer,
Accelerator.prepare (fsdp2_prepare_model, fsdp2_switch_optimizer_parameters) and the training loop, is the
libraries' own code."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

from harness import run_ranks  # noqa: E402
from _tiny_llama import tiny_llama  # noqa: E402 (tests/integrations/_tiny_llama.py)

pytestmark = pytest.mark.slow  # multi-process

STEPS, PER_RANK, WORLD = 3, 2, 2


def _rows():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := (torch.randint(0, 128, (1,), generator=g) + torch.arange(16)) % 128),
             "labels": ids} for _ in range(STEPS * PER_RANK * WORLD)]


def _trainer(out: str, batch: int):
    import transformers

    from flashdist.integrations import transformers as fd_hf

    fd_hf.register(deepspeed=False)
    args = transformers.TrainingArguments(output_dir=out, optim="flash_adamw", learning_rate=1e-2, max_steps=STEPS,
                                          per_device_train_batch_size=batch, logging_steps=1, report_to=[],
                                          save_strategy="no", disable_tqdm=True, seed=0,
                                          # no clipping: FSDP2 sums the sharded norms in another order
                                          dataloader_num_workers=0, max_grad_norm=0.0,
                                          dataloader_pin_memory=False)  # CPU: no accelerator to pin memory for
    class Recording(transformers.Trainer):
        """The Trainer, noting the first token of each sample it trains on."""

        seen: list = []

        def training_step(self, model, inputs, *a, **k):
            self.seen.append(inputs["input_ids"][:, 0].tolist())
            return super().training_step(model, inputs, *a, **k)

    return Recording(model=tiny_llama(), args=args, train_dataset=_rows())


def _full(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def _rank(rank: int, world: int, out: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor

    trainer = _trainer(out, PER_RANK)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            cpu_ram_efficient_loading=False)
    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    assert trainer.accelerator.is_fsdp2
    trainer.train()
    opt = trainer.optimizer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    state_ok = (all(isinstance(p, DTensor) for p in params) and set(map(id, opt.state)) == set(map(id, params))
                and all(s["rho"].dtype == torch.int8 and isinstance(s["rho"], DTensor) for p, s in opt.state.items()
                        if p.dim() > 1))
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {"weights": _full(trainer.model), "state_ok": state_ok, "losses": losses, "seen": trainer.seen,
            "dtypes": sorted({str(p.dtype) for p in params})}


def test_trainer_fsdp2_optim_flash_adamw_equals_one_process():
    with tempfile.TemporaryDirectory(prefix="flashdist-trainer-fsdp2-") as out:
        ranks = run_ranks(_rank, WORLD, out, timeout=300.0)
        single = _trainer(os.path.join(out, "single"), PER_RANK)
        single.train()
    want = _full(single.model)
    for rank, got in enumerate(ranks):
        assert got["state_ok"] and got["dtypes"] == ["torch.bfloat16"], rank
        assert got["losses"][-1] < got["losses"][0]
        # Under this set-up every rank's DataLoader yields the one-process batches (observed, and checked here),
        # so FSDP2's gradient average is exact and flashdist's row-aligned step must give the same bits.
        assert got["seen"] == single.seen, rank
        for name, value in want.items():
            assert torch.equal(got["weights"][name], value), f"rank {rank}: {name} differs from one process"
