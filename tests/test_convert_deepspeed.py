"""``flashdist convert --from deepspeed``: DeepSpeed ZeRO 2/3 checkpoints of FlashAdamW (fp32 master partitions,
and bf16 master partitions + rho) -> DCP -> FSDP2 + FlashAdamW, which continues on DeepSpeed's loss curve.

One 2-rank DeepSpeed job (DS_ACCELERATOR=cpu, gloo) trains the same tiny LM in every mode, saves a checkpoint
and keeps training; the checkpoints are converted by the CLI, loaded into FSDP2 on 2 ranks, trained on the
same batches, and compared: the 24-bit master weights exactly, the losses within a tolerance (the moments are
re-quantized in FSDP2's row-aligned groups of 32 instead of DeepSpeed's flat ones). Plus bad input: a rank's
file missing, another optimizer, an unknown tag, an existing output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from flashdist._compat import HAS_DEEPSPEED
from _cli import assert_inspect_reads_structure_like_whole, run_cli as _cli  # tests/_cli.py
from flashdist.quant import rho as R

from harness import run_ranks
from test_deepspeed import VOCAB, Net  # the same tiny language model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed "
                                                   "(DS_BUILD_OPS=0 pip install deepspeed; launch/setup.sh does)")]

WORLD, GLOBAL_BATCH = 2, 24
LR, WEIGHT_DECAY = 1e-3, 0.1
SAVE_AT, AFTER = 4, 3  # steps before the checkpoint, steps after it
RUNS = {  # key -> (ZeRO stage, bf16 master partitions, state_dict_format)
    "zero2-fp32-masters": (2, False, "portable"),
    "zero2-bf16-masters": (2, True, "portable"),
    "zero3-fp32-masters": (3, False, "portable"),
    "zero3-bf16-masters": (3, True, "portable"),
    "zero2-fp32-masters-compressed": (2, False, "compressed"),
}


def _groups(model) -> list[dict]:
    """Two param groups, as launch/train.py and launch/train_deepspeed.py make them."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(step: int, rank: int):
    n = GLOBAL_BATCH // WORLD
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(step))
    y = (7 * x + 3) % VOCAB
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _mean(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _deepspeed_job(rank: int, world: int, root: str) -> dict:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from collections import defaultdict

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = defaultdict(bool)  # no C++ extensions on CPU (see test_deepspeed.py)
    from flashdist.integrations import deepspeed as fds

    out = {}
    for key, (stage, bf16_masters, fmt) in list(RUNS.items()) + [("zero2-torch-adamw", (2, False, None))]:
        config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
                  "optimizer": {"type": "FlashAdamW", "params": {"lr": LR, "state_dict_format": fmt}}}
        if fmt is None:
            config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}
        if bf16_masters:
            config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        torch.manual_seed(0)
        model = Net()
        engine, *_ = fds.initialize(model=model, model_parameters=_groups(model), config=config)
        losses = []
        for step in range(SAVE_AT + AFTER):
            if step == SAVE_AT:
                engine.save_checkpoint(os.path.join(root, key), tag=f"step{step}")
                if fmt is not None:
                    out[f"{key}/masters"] = fds.fp32_master_weights(engine)
            x, y = _batch(step, rank)
            loss = nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(_mean(loss))
        out[f"{key}/losses"] = losses
        engine.destroy()
    return out


def _fsdp_job(rank: int, world: int, jobs: list[tuple[str, int]]) -> list[dict]:
    """For each (converted checkpoint, master_weight_bits): load into FSDP2 + FlashAdamW and train the steps after
    the save on DeepSpeed's batches. One process launch for all of them."""
    from torch.distributed.fsdp import fully_shard

    import flashdist
    from flashdist import FlashAdamW, checkpoint

    results = []
    for path, bits in jobs:
        torch.manual_seed(1)  # other weights than DeepSpeed's: everything must come from the checkpoint
        model = Net().to(torch.bfloat16)
        for module in model.children():
            fully_shard(module)
        fully_shard(model)
        opt = FlashAdamW(_groups(model), lr=LR, master_weight_bits=bits)
        extra = checkpoint.load(path, model, opt)
        masters = flashdist.export_fp32_state_dict(model, opt, rank0_only=False)
        losses = []
        for step in range(extra["step"], extra["step"] + AFTER):
            x, y = _batch(step, rank)
            loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            opt.step()
            opt.zero_grad()
            losses.append(_mean(loss))
        results.append({"step": extra["step"], "masters": masters, "losses": losses})
    return results




RESUMED = {"zero2-fp32-masters": 24, "zero2-bf16-masters": 24, "zero3-fp32-masters": 24, "zero3-bf16-masters": 24,
           "zero3-fp32-masters/32-bit": 32}


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """DeepSpeed trains and saves (one 2-rank launch), the CLI converts, FSDP2 resumes (one 2-rank launch)."""
    root = tmp_path_factory.mktemp("ds")
    runs = run_ranks(_deepspeed_job, WORLD, str(root), timeout=300)[0]
    converted, jobs = {}, []
    for name, bits in RESUMED.items():
        key = name.split("/")[0]
        dst = root / f"{name.replace('/', '-')}.dcp"
        converted[name] = _cli("convert", root / key, dst, "--from", "deepspeed", "--to", "dcp",
                               "--master-weight-bits", bits)
        jobs.append((str(dst), bits))
    resumed = dict(zip(RESUMED, run_ranks(_fsdp_job, WORLD, jobs, timeout=300)[0]))
    return root, runs, converted, resumed


@pytest.mark.parametrize("name", RESUMED)
def test_deepspeed_to_dcp_then_fsdp2_continues(deepspeed_runs, name):
    """The 24-bit masters arrive exactly, and FSDP2 continues on DeepSpeed's loss curve.

    Tolerances. The first loss after the load comes before any optimizer step: bf16 masters + rho give the same
    bf16 weights, so the same loss; fp32 masters split into bf16 + rho give weights that differ from DeepSpeed's
    round-to-nearest bf16 copy by one ulp in rare half-step windows (measured 5e-6 relative). Each later step
    differs by the moments' re-quantization in FSDP2's row-aligned groups of 32 (DeepSpeed's are flat groups),
    FSDP2's bf16 reduce-scatter against DeepSpeed's bf16 all-reduce, and, for fp32 masters, FlashAdamW's
    param + rho update against DeepSpeed's fp32 partition update: measured at most 6.2e-5 relative after one
    step and 2.9e-4 after two. Checked at 2e-4 and 1e-3; a wrong optimizer state is far outside (measured:
    exp_avg halved moves the loss after one step by 4e-3, a wrong step count by 3e-3, the moments of two
    parameters swapped by a factor 90)."""
    root, runs, converted, resumed = deepspeed_runs
    key, bits = name.split("/")[0], RESUMED[name]
    stage, bf16_masters, _ = RUNS[key]
    rc, out, err = converted[name]
    assert rc == 0 and "wrote" in out and not err, err
    rc, out, _ = _cli("inspect", root / key)
    assert rc == 0 and f"ZeRO-{stage}" in out and f"step                {SAVE_AT}" in out
    result = resumed[name]
    assert result["step"] == SAVE_AT
    for param, master in runs[f"{key}/masters"].items():
        if bf16_masters or bits == 32:  # bf16 master + rho, or fp32 masters into int16 rho: bit for bit
            expected = master
        else:  # fp32 masters kept to 24 bits: parameter + int8 rho
            expected = R.merge(*R.split(master, torch.bfloat16, torch.int8))
        assert torch.equal(result["masters"][param], expected), param
    ds_after = torch.tensor(runs[f"{key}/losses"][SAVE_AT:])
    fsdp_after = torch.tensor(result["losses"])
    if bf16_masters or bits == 32:
        assert fsdp_after[0] == ds_after[0]
    torch.testing.assert_close(fsdp_after[0], ds_after[0], rtol=2e-5, atol=0)
    torch.testing.assert_close(fsdp_after[1], ds_after[1], rtol=2e-4, atol=0)
    torch.testing.assert_close(fsdp_after, ds_after, rtol=1e-3, atol=0)


@pytest.mark.parametrize("key", RUNS)
def test_inspect_reads_the_structure_and_says_what_a_whole_read_says(deepspeed_runs, monkeypatch, key):
    """inspect maps every rank's files and reassembles meta partitions: its output (text and --json) and the
    source's plain data and specs equal those of the whole read, in every ZeRO stage and master mode."""
    root = deepspeed_runs[0]
    assert_inspect_reads_structure_like_whole(root / key, monkeypatch)


def test_compressed_optimizer_state_converts_like_portable(deepspeed_runs):
    """state_dict_format='compressed' under DeepSpeed: codes and scales in flat groups, dequantized by the
    converter; the run is the same run as the portable one, so the result is the same, tensor for tensor."""
    from flashdist.checkpoint.convert import read

    root, runs, _, _ = deepspeed_runs
    assert runs["zero2-fp32-masters-compressed/losses"] == runs["zero2-fp32-masters/losses"]
    a, b = read(root / "zero2-fp32-masters-compressed"), read(root / "zero2-fp32-masters")
    assert a["model"].keys() == b["model"].keys() and a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
        for k, v in b["optim"]["state"][name].items():
            assert torch.equal(a["optim"]["state"][name][k], v), (name, k)
    groups = a["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [["emb.weight", "up.weight", "down.weight", "head.weight"],
                                             ["norm.weight", "norm.bias", "up.bias", "down.bias"]]
    assert [g["weight_decay"] for g in groups] == [WEIGHT_DECAY, 0.0]
    assert all(g["flat_layout"] is False and g["flashdist_format"] == "portable" for g in groups)


def test_export_gives_the_live_engine_masters(deepspeed_runs, tmp_path):
    """`flashdist export` of a DeepSpeed folder: the fp32 masters of the live engine at the save, bit for bit
    (fp32 master partitions too: the export goes through an int16 rho), like fds.export_fp32_state_dict."""
    safetensors = pytest.importorskip("safetensors.torch")
    root, runs, _, _ = deepspeed_runs
    for key in ("zero2-fp32-masters", "zero3-bf16-masters"):
        rc, _, err = _cli("export", root / key, tmp_path / f"{key}.safetensors")
        assert rc == 0, err
        exported = safetensors.load_file(tmp_path / f"{key}.safetensors")
        live = runs[f"{key}/masters"]
        assert exported.keys() == live.keys()
        for name in live:
            assert torch.equal(exported[name], live[name]), (key, name)


@pytest.mark.parametrize("key, victim", [("zero2-bf16-masters", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                         ("zero3-bf16-masters", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_a_missing_rank_fails_and_writes_nothing(deepspeed_runs, tmp_path, key, victim):
    root = deepspeed_runs[0]
    src = tmp_path / "ds"
    shutil.copytree(root / key, src)
    (src / f"step{SAVE_AT}" / victim).unlink()
    dst = tmp_path / "out"
    rc, out, err = _cli("convert", src, dst, "--from", "deepspeed", "--to", "dcp")
    assert rc == 1 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith("flashdist convert: ")
    assert f"lacks {victim}" in err and "rank 1 of 2" in err and "incomplete" in err
    assert not dst.exists() and not Path(str(dst) + ".tmp").exists()


def test_other_bad_input(deepspeed_runs, tmp_path):
    root = deepspeed_runs[0]
    dst = tmp_path / "out"
    rc, _, err = _cli("convert", root / "zero2-torch-adamw", dst, "--to", "dcp")
    assert rc == 1 and "saved by another optimizer" in err and len(err.strip().splitlines()) == 1
    rc, _, err = _cli("convert", root / "zero2-bf16-masters", dst, "--to", "dcp", "--tag", "step99")
    assert rc == 1 and "step99 does not exist" in err
    dst.mkdir()
    rc, _, err = _cli("convert", root / "zero2-bf16-masters", dst, "--to", "dcp")
    assert rc == 1 and "--force" in err and not any(dst.iterdir())
    rc, _, err = _cli("convert", root / "zero2-bf16-masters", dst, "--to", "dcp", "--force", "--tag", f"step{SAVE_AT}")
    assert rc == 0 and (dst / ".metadata").is_file(), err
    assert not any(tmp_path.glob("*.tmp"))
