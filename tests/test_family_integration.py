"""FlashSGD and FlashLion on FlashAdamW's checkpoint layers (issue #8): ``flashdist.checkpoint.save`` / ``load``
and the fp32 export/import in one process and under FSDP2 on 2 ranks; the ``flashdist`` command on their DCP
checkpoints (inspect, ``convert --format`` both ways, export); a checkpoint of another optimizer refused with a
reason; ``convert --from deepspeed`` of their ZeRO checkpoints, resumed by FSDP2.

The momentum buffer and Lion's ``exp_avg`` are first moments: signed int8 codes (only ``*_sq`` moments are
uint8). Converting one format into the other must give, tensor for tensor, what the optimizer itself saves in
that format after the same steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_ranks
from test_checkpoint_reshard import _gather, _model, _shard, _train

import flashdist
from flashdist import FlashAdamW, FlashLion, FlashSGD, checkpoint
from flashdist import distributed as D
from flashdist.checkpoint import CheckpointError
from flashdist.checkpoint.convert import read
from flashdist.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAMILY = {
    "sgd-nesterov": (FlashSGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3), "momentum_buffer"),
    "sgd-plain": (FlashSGD, dict(lr=1e-2), None),  # momentum 0: no buffer
    "lion": (FlashLion, dict(lr=1e-3, weight_decay=0.1), "exp_avg"),
}
FORMATS = ("portable", "compressed")
STEPS = 2


def _build(name: str, fmt: str, distributed: bool = False):
    model = _model()
    if distributed:
        _shard(model)
    cls, kwargs, _ = FAMILY[name]
    return model, cls(model.named_parameters(), state_dict_format=fmt, **kwargs)


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys()))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


# ----- one process ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", FAMILY)
def test_save_load_resume_and_fp32_round_trip(tmp_path, name, fmt):
    model, opt = _build(name, fmt)
    _train(model, opt, 0, STEPS)
    checkpoint.save(tmp_path / "ck", model, opt, extra={"step": STEPS})
    model2, opt2 = _build(name, fmt)
    assert checkpoint.load(tmp_path / "ck", model2, opt2)["step"] == STEPS
    _same(_gather(model, opt), _gather(model2, opt2), "loaded")
    _train(model, opt, STEPS, 2)
    _train(model2, opt2, STEPS, 2)
    _same(_gather(model, opt), _gather(model2, opt2), "resumed")

    weights = flashdist.export_fp32_state_dict(model, opt)
    model3, opt3 = _build(name, fmt)
    flashdist.load_fp32_state_dict(model3, opt3, weights)
    for fqn, p in model.named_parameters():
        assert torch.equal(weights[fqn], opt.master_weight(p)), fqn
        assert torch.equal(opt3.master_weight(dict(model3.named_parameters())[fqn]), weights[fqn]), fqn


def test_checkpoint_of_another_optimizer_is_refused_with_the_reason(tmp_path):
    model, opt = _build("sgd-nesterov", "portable")
    _train(model, opt, 0, STEPS)
    checkpoint.save(tmp_path / "sgd", model, opt)
    for cls, kwargs, saying in [
        (FlashLion, {}, r"holds \['momentum_buffer'\] \(FlashSGD/FlashSGDW with momentum, or FlashMuon on "
                        r"matrices only\), this optimizer's \['exp_avg'\] \(FlashLion\)"),
        (FlashAdamW, {}, r"this optimizer's \['exp_avg', 'exp_avg_sq'\]"),
        (FlashSGD, {}, r"this optimizer's none \(FlashSGD without momentum\)"),
    ]:
        other = _model()
        other_opt = cls(other.named_parameters(), lr=1e-2, **kwargs)
        before = _gather(other, other_opt)
        with pytest.raises(CheckpointError, match=saying):
            checkpoint.load(tmp_path / "sgd", other, other_opt)
        _same(before, _gather(other, other_opt), f"{cls.__name__} after a refused load")


# ----- FSDP2 on 2 ranks, then the command line ------------------------------------------------------------------


def _save_all_job(rank: int, world: int, root: str) -> dict:
    """Every optimizer and format: train under FSDP2, save DCP, export fp32 and import it into a fresh model."""
    out = {}
    for name in FAMILY:
        for fmt in FORMATS:
            model, opt = _build(name, fmt, distributed=True)
            _train(model, opt, 0, STEPS)
            checkpoint.save(f"{root}/{name}-{fmt}", model, opt, extra={"step": STEPS})
            out[f"{name}-{fmt}"] = _gather(model, opt)
        exported = flashdist.export_fp32_state_dict(model, opt, rank0_only=False)
        fresh, fresh_opt = _build(name, fmt, distributed=True)
        flashdist.load_fp32_state_dict(fresh, fresh_opt, exported)
        out[f"{name}/fp32"] = exported
        out[f"{name}/fp32 back"] = {fqn: D.full_tensor(fresh_opt.master_weight(p))
                                    for fqn, p in fresh.named_parameters()}
    return out


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    return root, run_ranks(_save_all_job, 2, str(root))[0]


@pytest.mark.parametrize("name", FAMILY)
def test_fsdp2_checkpoint_and_fp32_export(fsdp_checkpoints, name):
    root, saved = fsdp_checkpoints
    model, opt = _build(name, "portable")
    _train(model, opt, 0, STEPS)
    reference = _gather(model, opt)
    for fmt in FORMATS:
        _same(reference, saved[f"{name}-{fmt}"], f"{name} {fmt}: 2 ranks vs one process")
        loaded, loaded_opt = _build(name, fmt)  # the 2-rank checkpoint in a process without a process group
        checkpoint.load(root / f"{name}-{fmt}", loaded, loaded_opt)
        _same(reference, _gather(loaded, loaded_opt), f"{name} {fmt}: loaded from 2 ranks")
    _same(flashdist.export_fp32_state_dict(model, opt), saved[f"{name}/fp32"], f"{name}: fp32 export")
    _same(saved[f"{name}/fp32"], saved[f"{name}/fp32 back"], f"{name}: fp32 import under FSDP2")


def _optim_equal(a: dict, b: dict, what: str) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), (what, k)
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for fqn in sa:
        _same(sa[fqn], sb[fqn], f"{what}: {fqn}")


@pytest.mark.parametrize("name", FAMILY)
def test_cli_inspect_convert_export(fsdp_checkpoints, name, tmp_path, capsys):
    root, saved = fsdp_checkpoints
    moment = FAMILY[name][2]
    # inspect
    for fmt in FORMATS:
        capsys.readouterr()
        assert main(["inspect", str(root / f"{name}-{fmt}"), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kind"] == "dcp" and info["saved_world_size"] == 2 and info["step"] == STEPS
        assert info["optimizer_format"] == fmt and info["master_weight_bits"] == [24]
        keys = set(info["optimizer_state_keys"])
        assert {"rho", "step"} <= keys and not any(k.startswith("exp_avg_sq") for k in keys)
        if moment is None:
            assert keys == {"rho", "step"}
        else:
            assert (f"{moment}_codes" in keys) == (fmt == "compressed") and moment in keys  # 1-d: fp32
    # convert --format, both ways: what the optimizer itself saves in the other format
    for src, dst in (("compressed", "portable"), ("portable", "compressed")):
        out = tmp_path / f"{src}-to-{dst}.pt"
        assert main(["convert", str(root / f"{name}-{src}"), str(out), "--to", "torch", "--format", dst]) == 0
        converted, direct = read(out), read(root / f"{name}-{dst}")
        _optim_equal(direct, converted, f"{name} {src} -> {dst}")
        assert {g["flashdist_format"] for g in converted["optim"]["param_groups"]} == {dst}
        if moment is not None and dst == "compressed":
            assert converted["optim"]["state"]["uneven.weight"][f"{moment}_codes"].dtype == torch.int8
        # and back to DCP, loaded by the optimizer in the format written
        back = tmp_path / f"{src}-to-{dst}-dcp"
        assert main(["convert", str(out), str(back), "--to", "dcp"]) == 0
        model, opt = _build(name, dst)
        checkpoint.load(back, model, opt)
        _same(saved[f"{name}-{dst}"], _gather(model, opt), f"{name} {src} -> {dst} -> DCP, loaded")
    # export
    safetensors = pytest.importorskip("safetensors.torch", reason="safetensors is part of the [test] extra")
    assert main(["export", str(root / f"{name}-compressed"), str(tmp_path / "w.safetensors")]) == 0
    _same(saved[f"{name}/fp32"], safetensors.load_file(tmp_path / "w.safetensors"), f"{name}: flashdist export")


# ----- DeepSpeed ZeRO -> DCP -> FSDP2 ---------------------------------------------------------------------------

DS_RUNS = {  # key -> (optimizer type, its DeepSpeed params, ZeRO stage, bf16 master partitions)
    "FlashSGD-zero2-fp32": ("FlashSGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}, 2, False),
    "FlashLion-zero3-bf16": ("FlashLion", {"lr": 3e-4, "weight_decay": 0.3}, 3, True),
}


def _deepspeed_job(rank: int, world: int, root: str) -> dict:
    import os

    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from collections import defaultdict

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = defaultdict(bool)  # no C++ extensions on CPU (see test_deepspeed.py)
    import test_convert_deepspeed as T

    from flashdist.integrations import deepspeed as fds

    out = {}
    for key, (kind, params, stage, bf16_masters) in DS_RUNS.items():
        config = {"train_micro_batch_size_per_gpu": T.GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
                  "optimizer": {"type": kind, "params": params}}
        if bf16_masters:
            config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        torch.manual_seed(0)
        model = T.Net()
        engine, *_ = fds.initialize(model=model, model_parameters=T._groups(model), config=config)
        losses = []
        for step in range(T.SAVE_AT + T.AFTER):
            if step == T.SAVE_AT:
                engine.save_checkpoint(os.path.join(root, key), tag=f"step{step}")
                out[f"{key}/masters"] = fds.fp32_master_weights(engine)
            x, y = T._batch(step, rank)
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(T._mean(loss))
        out[f"{key}/losses"] = losses
        engine.destroy()
    return out


def _fsdp_resume_job(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    import test_convert_deepspeed as T

    out = {}
    for key, (kind, params, _, _) in DS_RUNS.items():
        torch.manual_seed(1)  # other weights than DeepSpeed's: everything must come from the checkpoint
        model = T.Net().to(torch.bfloat16)
        for module in model.children():
            fully_shard(module)
        fully_shard(model)
        opt = getattr(flashdist, kind)(T._groups(model), **params)
        extra = checkpoint.load(f"{root}/{key}.dcp", model, opt)
        out[f"{key}/masters"] = flashdist.export_fp32_state_dict(model, opt, rank0_only=False)
        losses = []
        for step in range(extra["step"], extra["step"] + T.AFTER):
            x, y = T._batch(step, rank)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            opt.step()
            opt.zero_grad()
            losses.append(T._mean(loss))
        out[f"{key}/losses"] = losses
    return out


@pytest.mark.slow
def test_deepspeed_checkpoints_convert_and_fsdp2_continues(tmp_path):
    """ZeRO-2 FlashSGD (fp32 master partitions) and ZeRO-3 FlashLion (bf16 masters + rho): the converter
    reassembles momentum_buffer / exp_avg like Adam's moments; FSDP2 gets the 24-bit masters exactly and continues
    on DeepSpeed's loss curve (tolerances: tests/test_convert_deepspeed.py)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra")
    import test_convert_deepspeed as T
    from test_deepspeed import DIM

    from flashdist.quant import rho as R

    runs = run_ranks(_deepspeed_job, 2, str(tmp_path), timeout=300)[0]
    for key, (kind, _, stage, _) in DS_RUNS.items():
        rc, out, err = T._cli("convert", tmp_path / key, tmp_path / f"{key}.dcp", "--from", "deepspeed", "--to", "dcp")
        assert rc == 0 and "wrote" in out, err
        state = read(tmp_path / f"{key}.dcp")["optim"]["state"]["up.weight"]
        moment = "momentum_buffer" if kind == "FlashSGD" else "exp_avg"
        assert set(state) == {"step", "rho", moment} and state[moment].dtype == torch.float32
        assert state[moment].shape == (4 * DIM, DIM) and state[moment].abs().max() > 0
        rc, out, _ = T._cli("inspect", tmp_path / key)
        assert rc == 0 and f"ZeRO-{stage}" in out
    resumed = run_ranks(_fsdp_resume_job, 2, str(tmp_path), timeout=300)[0]
    for key, (_, _, _, bf16_masters) in DS_RUNS.items():
        for param, master in runs[f"{key}/masters"].items():
            expected = master if bf16_masters else R.merge(*R.split(master, torch.bfloat16, torch.int8))
            assert torch.equal(resumed[f"{key}/masters"][param], expected), (key, param)
        ds_after = torch.tensor(runs[f"{key}/losses"][T.SAVE_AT:])
        fsdp_after = torch.tensor(resumed[f"{key}/losses"])
        torch.testing.assert_close(fsdp_after[0], ds_after[0], rtol=2e-5, atol=0)
        torch.testing.assert_close(fsdp_after, ds_after, rtol=1e-3, atol=0)
