"""Accelerate's FSDP2 flow with a flashdist optimizer built BEFORE ``prepare`` (as the HF Trainer does):
``prepare`` shards the model and swaps the optimizer's ``param_groups`` entries for the sharded DTensors
(accelerate.utils.fsdp_utils.fsdp2_switch_optimizer_parameters); the optimizer's state must follow. On 2
gloo ranks it trains, saves (``save_state``: DCP through ``save_fsdp_optimizer``) and resumes
(``load_state``) bit-identically to one process running flashdist on the unsharded model: FlashAdamW, and
FlashMuon, whose groups (``muon_param_groups``) are built before ``prepare`` too."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.slow  # multi-process

LR = 1e-2


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 40), torch.nn.Tanh(),
                                torch.nn.Linear(40, 8)).to(torch.bfloat16)
    model[0].requires_grad_(False)  # a frozen layer: no optimizer state, on every rank alike
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(1000 + step), dtype=torch.bfloat16)


def _train_step(model, optimizer, step: int, backward=None) -> None:
    loss = model(_batch(step)).float().pow(2).mean()
    (backward or torch.Tensor.backward)(loss)
    optimizer.step()
    optimizer.zero_grad()


def _optimizer(model, name: str):
    """FlashAdamW over every parameter, or FlashMuon over flashdist.muon_param_groups (its matrices Muon)."""
    import flashdist

    if name == "FlashMuon":
        return flashdist.FlashMuon(flashdist.muon_param_groups(model, adamw_lr=LR), lr=LR)
    return flashdist.FlashAdamW(model.parameters(), lr=LR)


def _single_process(steps: int, name: str = "FlashAdamW") -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _optimizer(model, name)
    for step in range(steps):
        _train_step(model, optimizer, step)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _accelerator(mixed_precision: str = "no"):
    """An Accelerator in its FSDP2 mode on the harness's gloo process group.

    Accelerate's launcher refuses ``--cpu`` with FSDP, so this sets up what a GPU launch would: the
    launcher's environment variables, then the FSDP distributed type and the FSDP2 plugin in accelerate's
    shared state (``Accelerator(cpu=True)`` picks MULTI_CPU; a GPU launch with ``--use_fsdp`` picks FSDP).
    Everything after that, ``prepare``, ``save_state`` and ``load_state``, is accelerate's own code."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            cpu_ram_efficient_loading=False, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # what AcceleratorState does for an FSDP launch
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _check_state_follows(model, optimizer) -> None:
    """After prepare: the optimizer holds the sharded DTensors and no state; a state dict then makes state for
    exactly the trainable ones, sharded like them."""
    from torch.distributed.tensor import DTensor

    import flashdist

    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(isinstance(p, DTensor) for p in params)
    trainable = [p for p in params if p.requires_grad]
    report = flashdist.memory_report(optimizer)  # first sight of the swapped-in parameters
    assert len(optimizer.state) == 0 and report["rho"] == report["codes"] == 0  # none before a step, as torch
    optimizer.state_dict()  # what a save before the first step calls: the zero state of every trainable one
    report = flashdist.memory_report(optimizer)
    assert set(map(id, optimizer.state)) == set(map(id, trainable))
    for p in trainable:
        for key, value in optimizer.state[p].items():
            if key != "step":
                assert isinstance(value, DTensor) and value.placements == p.placements, key
    local = sum(p.to_local().numel() for p in params)
    assert report["numel"] == local < sum(p.numel() for p in params)
    assert report["rho"] == sum(p.to_local().numel() for p in trainable)  # int8 rho of bf16 parameters


def _ranks(rank: int, world_size: int, folder: str, steps: int, name: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")

    # run 1: optimizer built on the unsharded model, then prepare; save before the first step (state for
    # every trainable parameter must exist on every rank for DCP) and halfway
    accelerator = _accelerator()
    model = _model()
    optimizer = _optimizer(model, name)
    model, optimizer = accelerator.prepare(model, optimizer)
    _check_state_follows(model, optimizer.optimizer)
    accelerator.save_state(os.path.join(folder, "before-first-step"))
    for step in range(steps):
        if step == steps // 2:
            accelerator.save_state(os.path.join(folder, "halfway"))
        _train_step(model, optimizer, step, accelerator.backward)
    straight = _full_params(model)
    # run 2: a fresh job resumes from the halfway checkpoint
    accelerator = _accelerator()
    model = _model()
    optimizer = _optimizer(model, name)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(os.path.join(folder, "halfway"))
    steps_done = {float(s["step"]) for s in optimizer.optimizer.state.values()}
    for step in range(steps // 2, steps):
        _train_step(model, optimizer, step, accelerator.backward)
    resumed = _full_params(model)
    return {"straight": straight, "resumed": resumed, "steps_done": steps_done}


@pytest.mark.parametrize("name", ["FlashAdamW", "FlashMuon"])
def test_accelerate_fsdp2_trains_saves_and_resumes_exactly(name):
    pytest.importorskip("accelerate")
    steps = 4
    with tempfile.TemporaryDirectory(prefix="flashdist-accelerate-") as folder:
        results = run_ranks(_ranks, 2, folder, steps, name, timeout=180.0)
    want = _single_process(steps, name)
    for rank, got in enumerate(results):
        assert got["steps_done"] == {steps // 2}, f"rank {rank}: resumed at steps {got['steps_done']}"
        for run in ("straight", "resumed"):
            assert got[run].keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(got[run][name], value), f"rank {rank}, {run}: {name} differs from one process"


def _mixed_precision_ranks(rank: int, world_size: int) -> list[str]:
    import warnings

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    import flashdist

    accelerator = _accelerator("bf16")
    model = _model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optimizer = flashdist.FlashAdamW(model.parameters(), lr=LR)  # bf16 parameters: nothing to say yet
        model, optimizer = accelerator.prepare(model, optimizer)  # upcasts them to fp32 DTensors
        for step in range(2):
            _train_step(model, optimizer, step, accelerator.backward)
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    # the precise check, from the module's FSDP2 state: the trainable parameters (not the frozen layer), and
    # nothing for a model FSDP2 computes in fp32
    found = optimizer.optimizer.check_precision(model)
    assert found == ["1.weight", "1.bias", "3.weight", "3.bias"], found
    messages = [str(w.message) for w in record if issubclass(w.category, flashdist.PrecisionWarning)]
    plain = torch.nn.Linear(8, 8)
    from torch.distributed.fsdp import fully_shard

    fully_shard(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flashdist.PrecisionWarning)
        fp32_optimizer = flashdist.FlashAdamW(plain.parameters(), master_weight_bits=None)  # fp32 on purpose
        assert fp32_optimizer.check_precision(plain) == []
    return messages


def test_accelerate_fsdp2_mixed_precision_warns_once_about_fp32_parameters():
    # Accelerate's FSDP2 with mixed_precision="bf16" upcasts the bf16 parameters to fp32 masters and computes
    # in bf16 (MixedPrecisionPolicy): flashdist then keeps fp32 gradients and no rho, and says so once
    pytest.importorskip("accelerate")
    for rank, messages in enumerate(run_ranks(_mixed_precision_ranks, 2, timeout=180.0)):
        assert len(messages) == 1, f"rank {rank}: {messages}"
        assert "docs/integrations.md" in messages[0] and "master_weight_bits=None" in messages[0]
