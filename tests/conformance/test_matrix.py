"""The conformance matrix: every cell of conformance_table.CELLS (client x engine x optimizer x stage) runs
the invariants of conformance_invariants.py, is refused with a reason docs/integrations.md lists (the cell
asserts it is listed), or waits (strict xfail) for the fix of the issue item it names.

Cost: a run per (client, engine, optimizer) does every stage at once and records each stage's outcome; the
cells read those records. The multi-rank engines run every optimizer in one spawn per (client, engine) (DeepSpeed:
one spawn for ZeRO-2 and ZeRO-3; the Trainer and Accelerate under DeepSpeed: one spawn for the four paths), and a
resume at another world size in one more spawn of 1 rank. Measured on 2 CPU cores: DeepSpeed 22 s, the Trainer
under FSDP2 33 s, Accelerate under FSDP2 8 s, the Trainer and Accelerate under DeepSpeed 23 s
(both spawns)."""

from __future__ import annotations

import fnmatch
import json
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parents[1]
for _folder in (_TESTS, _TESTS / "integrations"):  # tests/_cli.py, and the clients' setups to reuse
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from _cli import run_cli  # noqa: E402
from conformance_invariants import (assert_masters_from,
                                    assert_memory_before_first_step_within_adamw, assert_noop_option_says_so_once,
                                    assert_outside_write_is_own_master, assert_resume_exact,
                                    assert_state_only_for_trainable, live_masters, snapshot)
from conformance_table import CELLS, OPTIMIZERS, REFUSED, cell_id, expected_failure, refused
from documented import DOCS, documented_patterns, refusal_documented
from harness import run_ranks

from flashdist import distributed as D

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 2  # steps before the checkpoint, and again after it


class StageFailure(AssertionError):
    """A stage of a run failed: its traceback, for the cell that reads it."""


def _attempt(results: dict, stage: str, fn, *args) -> None:
    """Run one stage's check and record its outcome (None: kept the invariants)."""
    try:
        fn(*args)
        results[stage] = None
    except Exception:  # noqa: BLE001 - recorded for the cell, raised there
        results[stage] = traceback.format_exc(limit=-6)


# ----- the plain loop: tests/distributed/test_checkpoint_reshard.py's model, with a frozen parameter ----------


def _plain_model():
    from test_checkpoint_reshard import _model

    model = _model()
    model.unused.weight.requires_grad_(False)  # frozen: must hold no state
    return model


def _plain_train(model, opt, first: int, n: int = STEPS) -> None:
    from test_checkpoint_reshard import _train

    _train(model, opt, first, n)


def _check_torch_save_file(results: dict, path: Path, live: dict, tmp: Path) -> None:
    """save / export-fp32 / inspect of a checkpoint file or folder that the CLI and the readers take."""
    from flashdist.checkpoint.convert import master_weights, read

    _attempt(results, "save", lambda: assert_masters_from(f"{path.name} (flashdist.checkpoint.convert)",
                                                          master_weights(read(path)), live))
    tmp.mkdir(parents=True, exist_ok=True)
    _attempt(results, "export-fp32", _export_fp32, path, tmp / "export.safetensors", live)
    _attempt(results, "inspect", _inspect, path)


def _export_fp32(path: Path, out: Path, live: dict) -> None:
    from safetensors.torch import load_file

    rc, _, err = run_cli("export", path, out, "--force")
    assert rc == 0, err.strip().splitlines()[-1:] if err.strip() else rc
    assert_masters_from(f"flashdist export {path.name}", load_file(out), live)


def _export_hf(path: Path, out: Path, live: dict, config: Path) -> None:
    from safetensors.torch import load_file

    rc, _, err = run_cli("export", path, out, "--hf", "--config", config, "--force")
    assert rc == 0, err.strip().splitlines()[-1:] if err.strip() else rc
    exported = {}
    for shard in sorted(out.glob("*.safetensors")):
        exported.update(load_file(shard))
    assert_masters_from(f"flashdist export --hf {path.name}", exported, live)


def _inspect(path: Path) -> None:
    rc, out, err = run_cli("inspect", path, "--json")
    assert rc == 0, err.strip().splitlines()[-1:] if err.strip() else rc
    info = json.loads(out)
    assert info["master_weight_bits"] == [24], info.get("master_weight_bits")


def _noop_graphed(entry) -> None:
    def build():
        return entry.build(torch.nn.Linear(32, 4, bias=False).to(torch.bfloat16), graphed=True)

    def step(opt):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()

    assert_noop_option_says_so_once(build, step, "graphed")


def _outside_write(opt, model) -> None:
    # the parameter with the most non-zero rho (a stale rho shows there); any trainable one without rho
    candidates = [p for p in model.parameters() if p.requires_grad and p.dim() == 2]
    p = max(candidates, key=lambda q: int(torch.count_nonzero(D.local(opt.state[q]["rho"])))
            if "rho" in opt.state.get(q, {}) else -1)
    shape = tuple(D.global_shape(p))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(p.dtype)
    assert_outside_write_is_own_master(opt, p, D.state_like(p, D.local_rows(full, p).clone(), shape))


def run_plain_one_process(name: str, tmp: Path) -> dict:
    entry, results = OPTIMIZERS[name], {}
    model = _plain_model()
    opt = entry.build(model)
    _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)
    _plain_train(model, opt, 0)
    _attempt(results, "train", assert_state_only_for_trainable, opt)
    live = live_masters(model, opt)
    path = tmp / "model_and_optim.pt"  # the most common checkpoint there is
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    _check_torch_save_file(results, path, live, tmp)
    _plain_train(model, opt, STEPS)
    uninterrupted = snapshot(model, opt)

    def resume():
        model2 = _plain_model()
        opt2 = entry.build(model2)
        saved = torch.load(path, weights_only=True)
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optim"])
        _plain_train(model2, opt2, STEPS)
        assert_resume_exact(uninterrupted, snapshot(model2, opt2), "plain, torch.save")

    _attempt(results, "resume-same", resume)
    _attempt(results, "noop-option", _noop_graphed, entry)
    _attempt(results, "outside-write", _outside_write, opt, model)
    return results


# ----- the plain loop on 2 gloo ranks: DDP and FSDP2, every optimizer in one spawn per engine -------------


class _Linearised(torch.nn.Module):
    """A forward whose backward gives each parameter the test's gradient exactly: DDP averages identical
    gradients of every rank, which is exact."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, grads: dict[str, torch.Tensor]):
        return sum((p.float() * grads[n].float()).sum() for n, p in self.net.named_parameters() if n in grads)


def _ddp_train(ddp, opt, first: int, n: int = STEPS) -> None:
    from test_checkpoint_reshard import _grads

    for step in range(first, first + n):
        ddp(_grads(step)).backward()
        opt.step()
        opt.zero_grad()


def _ddp_job(rank: int, world: int, root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name, entry in OPTIMIZERS.items():
        results = {}
        model = _plain_model()
        ddp = DistributedDataParallel(_Linearised(model), find_unused_parameters=True)
        opt = entry.build(model)
        _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)
        _ddp_train(ddp, opt, 0)
        _attempt(results, "train", assert_state_only_for_trainable, opt)
        path = f"{root}/ddp-{name}.pt"
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        torch.distributed.barrier()
        live = live_masters(model, opt)
        _ddp_train(ddp, opt, STEPS)
        uninterrupted = snapshot(model, opt)

        def resume():
            model2 = _plain_model()
            ddp2 = DistributedDataParallel(_Linearised(model2), find_unused_parameters=True)
            opt2 = entry.build(model2)
            saved = torch.load(path, weights_only=True)
            model2.load_state_dict(saved["model"])
            opt2.load_state_dict(saved["optim"])
            _ddp_train(ddp2, opt2, STEPS)
            assert_resume_exact(uninterrupted, snapshot(model2, opt2), "DDP on 2 ranks")

        _attempt(results, "resume-same", resume)
        _attempt(results, "outside-write", _outside_write, opt, model)
        out[name] = dict(results=results, live=live, uninterrupted=uninterrupted, path=path)
    return out


def _fsdp_job(rank: int, world: int, root: str) -> dict:
    from test_checkpoint_reshard import _shard

    from flashdist import checkpoint

    out = {}
    for name, entry in OPTIMIZERS.items():
        results = {}
        model = _shard(_plain_model())
        opt = entry.build(model)
        _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)
        _plain_train(model, opt, 0)
        _attempt(results, "train", assert_state_only_for_trainable, opt)
        path = f"{root}/fsdp2-{name}"
        checkpoint.save(path, model, opt, extra={"step": STEPS})
        live = live_masters(model, opt)
        _plain_train(model, opt, STEPS)
        uninterrupted = snapshot(model, opt)

        def resume():
            model2 = _shard(_plain_model())
            opt2 = entry.build(model2)
            checkpoint.load(path, model2, opt2)
            _plain_train(model2, opt2, STEPS)
            assert_resume_exact(uninterrupted, snapshot(model2, opt2), "FSDP2 on 2 ranks")

        _attempt(results, "resume-same", resume)
        _attempt(results, "outside-write", _outside_write, opt, model)
        out[name] = dict(results=results, live=live, uninterrupted=uninterrupted, path=path)
    return out


def run_plain_multi_rank(engine: str, tmp: Path) -> dict[str, dict]:
    """Every optimizer of ``engine`` ("ddp", "fsdp2") on 2 ranks in one spawn, then resumed in this process
    (another world size) and read by the CLI."""
    from flashdist import checkpoint

    saved = run_ranks(_ddp_job if engine == "ddp" else _fsdp_job, 2, str(tmp))[0]
    runs = {}
    for name, run in saved.items():
        entry, results, path = OPTIMIZERS[name], run["results"], Path(run["path"])

        def resume_other():
            model = _plain_model()
            opt = entry.build(model)
            if engine == "ddp":
                ck = torch.load(path, weights_only=True)
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["optim"])
            else:
                checkpoint.load(path, model, opt)
            _plain_train(model, opt, STEPS)
            assert_resume_exact(run["uninterrupted"], snapshot(model, opt), f"{engine} checkpoint in one process")

        _attempt(results, "resume-other", resume_other)
        _check_torch_save_file(results, path, run["live"], tmp / f"out-{engine}-{name}")
        runs[name] = results
    return runs


# ----- the HF Trainer, and PEFT through it ---------------------------------------------------------------------


def _trainer_run(name: str, tmp: Path, client: str) -> dict:
    transformers = pytest.importorskip("transformers")
    import flashdist.integrations.transformers as fd_hf
    from _tiny_llama import tiny_llama  # noqa: F401 (tests/integrations: on sys.path through conftest)
    from test_hf_trainer import _data

    fd_hf.register()
    entry, results = OPTIMIZERS[name], {}
    optim = {cls: key for key, cls in fd_hf.OPTIMIZERS.items()}[name]
    extra = {k: v for k, v in entry.kwargs.items() if k not in ("lr", "weight_decay")}
    optim_args = ",".join(f"{k}={v}" for k, v in extra.items())

    def model():
        m = tiny_llama()
        if client.startswith("peft"):
            peft = pytest.importorskip("peft")
            m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
            if client == "peft-trainer-bf16":
                m.to(torch.bfloat16)
        return m

    def args(out, **over):
        kw = dict(output_dir=str(out), optim=optim, optim_args=optim_args, learning_rate=entry.kwargs["lr"],
                  weight_decay=entry.kwargs.get("weight_decay", 0.0), max_steps=2 * STEPS, save_steps=STEPS,
                  per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                  disable_tqdm=True, logging_strategy="no")
        kw.update(over)
        return transformers.TrainingArguments(**kw)

    seen = {}

    class Watch(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            opt = getattr(optimizer, "optimizer", optimizer)
            _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)

        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == STEPS:
                seen["live"] = live_masters(model, getattr(optimizer, "optimizer", optimizer))

    data = _data()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        full = transformers.Trainer(model=model(), args=args(tmp / "run"), train_dataset=data, callbacks=[Watch()])
        full.train()
    opt = getattr(full.optimizer, "optimizer", full.optimizer)

    def train_check():
        assert_state_only_for_trainable(opt)
        if client == "peft-trainer":  # PEFT's fp32 adapters: the warning's first advice must fit PEFT (keep fp32)
            said = [str(w.message) for w in record if "flashdist" in str(w.message) and "fp32" in str(w.message)]
            assert said and all(-1 < s.find("PEFT adapters") < s.find("keep them fp32") < s.find("Otherwise: ")
                                < s.find("model.to(torch.bfloat16)") for s in said), said

    _attempt(results, "train", train_check)
    uninterrupted = snapshot(full.model, opt)
    ckpt = tmp / "run" / f"checkpoint-{STEPS}"
    live = seen["live"]
    from flashdist.checkpoint.convert import master_weights, read

    if client == "trainer":
        _attempt(results, "save", lambda: assert_masters_from(f"Trainer {ckpt.name}", master_weights(read(ckpt)),
                                                              live))
    else:  # refused cells: an adapter-only folder gives no masters, and flashdist says so in one line
        _attempt(results, "save", _read_refused_in_one_line, ckpt)
        _attempt(results, "export-fp32", _refused_in_one_line, "export", ckpt, tmp / "export.safetensors")
        _attempt(results, "inspect", _refused_in_one_line, "inspect", ckpt)

    def resume():
        if client == "peft-trainer-bf16":  # the promise: the adapters resume on their exact masters
            got = {}

            class Loaded(transformers.TrainerCallback):  # after the checkpoint's weights and state are loaded
                def on_train_begin(self, args, state, control, model=None, **kw):
                    got.update({n: p.detach().float().clone() for n, p in model.named_parameters()
                                if p.requires_grad})

            resumed = transformers.Trainer(model=model(), args=args(tmp / "resumed"), train_dataset=data,
                                           callbacks=[Loaded()])
            resumed.train(resume_from_checkpoint=str(ckpt))
            assert_masters_from("PEFT's resumed adapters", got, live)
            return
        resumed = transformers.Trainer(model=model(), args=args(tmp / "resumed"), train_dataset=data)
        resumed.train(resume_from_checkpoint=str(ckpt))
        assert_resume_exact(uninterrupted, snapshot(resumed.model, getattr(resumed.optimizer, "optimizer",
                                                                          resumed.optimizer)), client)

    _attempt(results, "resume-same", resume)
    if client == "trainer":
        _attempt(results, "export-fp32", _export_fp32, ckpt, tmp / "export.safetensors", live)
        _attempt(results, "export-hf", _export_hf, ckpt, tmp / "hf", live, ckpt / "config.json")
        _attempt(results, "inspect", _inspect, ckpt)

        def noop():
            def build():  # the optimizer the Trainer builds from optim_args, stepped as the Trainer steps it
                graphed = ",".join(filter(None, (optim_args, "graphed=true")))
                return transformers.Trainer(model=model(), args=args(tmp / "graphed", optim_args=graphed),
                                            train_dataset=data).create_optimizer()

            def step(opt):
                for group in opt.param_groups:
                    for p in group["params"]:
                        p.grad = torch.ones_like(p)
                opt.step()

            assert_noop_option_says_so_once(build, step, "graphed")

        _attempt(results, "noop-option", noop)
    _attempt(results, "outside-write", _outside_write, opt, full.model)
    return results


# ----- Accelerate, one process ---------------------------------------------------------------------------------


def run_accelerate(name: str, tmp: Path) -> dict:
    accelerate = pytest.importorskip("accelerate")
    entry, results = OPTIMIZERS[name], {}

    def build():
        accelerator = accelerate.Accelerator(cpu=True)
        model = _plain_model()
        opt = entry.build(model)
        _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)
        model, prepared = accelerator.prepare(model, opt)
        return accelerator, model, prepared, opt

    accelerator, model, prepared, opt = build()
    _plain_train(model, prepared, 0)
    _attempt(results, "train", assert_state_only_for_trainable, opt)
    live = live_masters(model, opt)
    folder = tmp / "state"
    accelerator.save_state(str(folder))
    _plain_train(model, prepared, STEPS)
    uninterrupted = snapshot(model, opt)

    def resume():
        accelerator2, model2, prepared2, opt2 = build()
        accelerator2.load_state(str(folder))
        _plain_train(model2, prepared2, STEPS)
        assert_resume_exact(uninterrupted, snapshot(model2, opt2), "Accelerate save_state / load_state")

    _attempt(results, "resume-same", resume)
    _check_torch_save_file(results, folder, live, tmp / "out")
    _attempt(results, "outside-write", _outside_write, opt, model)
    return results


# ----- Lightning, one process ----------------------------------------------------------------------------------


def run_lightning(name: str, tmp: Path) -> dict:
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning import TinyRegressor, _data

    entry, results = OPTIMIZERS[name], {}

    class Module(TinyRegressor):
        def configure_optimizers(self):
            return entry.build(self)

        def on_train_start(self):
            if self.global_step == 0:
                _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw,
                         self.trainer.optimizers[0], self)

    def fit(epochs, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        module = Module()
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, precision="bf16-true",
                            callbacks=list(callbacks), logger=False, enable_checkpointing=bool(callbacks),
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(module, _data(), ckpt_path=ckpt_path)
        return module, trainer.optimizers[0]

    every = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    module, opt = fit(2, callbacks=[every])
    _attempt(results, "train", assert_state_only_for_trainable, opt)
    uninterrupted = snapshot(module, opt)

    def resume():
        first = sorted((tmp / "ckpt").glob("epoch=0-*.ckpt"))[0]
        module2, opt2 = fit(2, ckpt_path=str(first))
        assert_resume_exact(uninterrupted, snapshot(module2, opt2), "Lightning fit(ckpt_path=)")

    _attempt(results, "resume-same", resume)
    _attempt(results, "outside-write", _outside_write, opt, module)
    ckpt = sorted((tmp / "ckpt").glob("*.ckpt"))[0]  # refused cells: flashdist must say so in one line
    _attempt(results, "export-fp32", _refused_in_one_line, "export", ckpt, tmp / "export.safetensors")
    _attempt(results, "inspect", _refused_in_one_line, "inspect", ckpt)
    return results


def _refused_in_one_line(*command) -> None:
    rc, _, err = run_cli(*command)
    assert rc not in (0, None), f"flashdist {command[0]} exit {rc}: it read a checkpoint it cannot read"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashdist"), lines


def _read_refused_in_one_line(path: Path) -> None:
    from flashdist.checkpoint.convert import master_weights, read
    from flashdist.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError) as refused:
        master_weights(read(path))
    text = str(refused.value)
    assert "\n" not in text and text.startswith("flashdist") and str(path) in text, text


# ----- torchtitan under FSDP2 ----------------------------------------------------------------------------------


def _titan_setup(name: str, folder: str, seed: int):
    from test_torchtitan import _model
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from flashdist.integrations.torchtitan import HELPERS

    model = _model(seed)
    fully_shard(model.proj)
    fully_shard(model)
    kwargs = {k: v for k, v in OPTIMIZERS[name].kwargs.items() if k != "lr"}
    container = HELPERS[name](OPTIMIZERS[name].kwargs["lr"], **kwargs).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=container, training_steps=10)
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1).build(
        dataloader=None, model_parts=[model], optimizers=container, lr_schedulers=schedulers, states={},
        sd_adapter=None, base_folder=folder)
    return model, container, schedulers, manager


def _titan_job(rank: int, world: int, root: str, resume_only: bool) -> dict:
    from test_torchtitan import _train

    out = {}
    for name in OPTIMIZERS:
        folder = f"{root}/titan-{name}"
        results = {}
        if not resume_only:
            model, container, schedulers, manager = _titan_setup(name, folder, seed=0)
            (opt,) = list(container)
            _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, opt, model)
            _train(model, container, schedulers, 0, STEPS)
            _attempt(results, "train", assert_state_only_for_trainable, opt)
            manager.save(curr_step=STEPS)
            manager.close()
            live = live_masters(model, opt)
            _train(model, container, schedulers, STEPS, STEPS)
            uninterrupted = snapshot(model, opt)
            _attempt(results, "outside-write", _outside_write, opt, model)
            out[name] = dict(results=results, live=live, uninterrupted=uninterrupted,
                             path=f"{folder}/checkpoint/step-{STEPS}")
        model, container, schedulers, manager = _titan_setup(name, folder, seed=1)
        assert manager.load(step=STEPS)
        manager.close()
        _train(model, container, schedulers, STEPS, STEPS)
        (opt,) = list(container)
        out.setdefault(name, {})["resumed"] = snapshot(model, opt)
    return out


def run_torchtitan(tmp: Path) -> dict[str, dict]:
    pytest.importorskip("torchtitan")
    saved = run_ranks(_titan_job, 2, str(tmp), False)[0]
    other = run_ranks(_titan_job, 1, str(tmp), True)[0]
    runs = {}
    for name, run in saved.items():
        results = run["results"]
        _attempt(results, "resume-same", assert_resume_exact, run["uninterrupted"], run["resumed"], "torchtitan, 2")
        _attempt(results, "resume-other", assert_resume_exact, run["uninterrupted"], other[name]["resumed"],
                 "torchtitan, 2 -> 1")
        _check_torch_save_file(results, Path(run["path"]), run["live"], tmp / f"out-titan-{name}")
        runs[name] = results
    return runs


# ----- DeepSpeed ZeRO-2 and ZeRO-3 through fds.initialize, 2 gloo ranks ----------------------------------------

DS_ENGINES = {"zero2": 2, "zero3": 3}
DS_UNIVERSAL = ("FlashAdamW", "FlashAdam")  # ds_to_universal carries Adam's moments only (docs/deepspeed.md)


def _ds_model():
    """Every trainable tensor a multiple of 64 values, so that ZeRO's partitions on 2 ranks and on 1 cut the
    8-bit moments' groups of 32 alike (a universal resume can then be exact); a frozen layer between."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16, bias=False),
                                torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64, bias=False))
    model[1].requires_grad_(False)
    return model


def _ds_config(engine: str, name: str, universal: bool = False) -> dict:
    """bf16 master partitions + rho (24-bit masters), the mode where flashdist holds part of the master."""
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": DS_ENGINES[engine]},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
              "optimizer": {"type": name, "params": dict(OPTIMIZERS[name].kwargs)}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _ds_engine(engine: str, name: str, universal: bool = False):
    from flashdist.integrations import deepspeed as fds

    model = _ds_model()
    ds, *_ = fds.initialize(model=model, model_parameters=model.parameters(),
                            config=_ds_config(engine, name, universal))
    return ds


def _ds_train(ds, first: int, n: int = STEPS) -> None:
    """Every rank trains on the same batch: the gradient average is exact, so 2 ranks and 1 step alike."""
    for step in range(first, first + n):
        x = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(ds(x).float(), (7 * x + 3) % 64)
        ds.backward(loss)
        ds.step()


def _ds_masters(ds) -> dict[str, torch.Tensor]:
    """The live fp32 masters (bf16 partition + rho, gathered) of the trainable parameters; every rank calls it."""
    from flashdist.integrations import deepspeed as fds

    trainable = {n for n, p in ds.module.named_parameters() if p.requires_grad}
    return {n: t for n, t in fds.fp32_master_weights(ds).items() if n in trainable}


def _ds_snapshot(ds) -> dict[str, torch.Tensor]:
    """This rank's master partitions and their optimizer state, and the full masters: what a resume must give."""
    from flashdist.integrations import deepspeed as fds

    out = {f"master:{n}": t for n, t in _ds_masters(ds).items()}
    opt = ds.basic_optimizer
    for i, part in enumerate(fds.master_partitions(ds)):
        out[f"partition{i}"] = part.detach().clone()
        for key, value in opt.state.get(part, {}).items():
            out[f"partition{i}:{key}"] = torch.as_tensor(value).clone()
    return out


def _ds_state_only_for_partitions(ds) -> None:
    """The flashdist optimizer holds state for this rank's master partitions only, and those hold the
    trainable parameters (the frozen layer is in no partition: the partitions of all ranks add up to the
    trainable values plus ZeRO's padding, under 64 values per rank)."""
    from flashdist.integrations import deepspeed as fds

    opt, parts = ds.basic_optimizer, fds.master_partitions(ds)
    stray = [tuple(k.shape) for k in opt.state if not any(k is p for p in parts) and opt.state[k]]
    assert not stray, f"state for {len(stray)} tensors that are not this rank's master partitions: {stray[:3]}"
    assert all(p in opt.state for p in parts), "a master partition has no state after the steps"
    total = torch.tensor(sum(p.numel() for p in parts))
    torch.distributed.all_reduce(total)
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in ds.module.parameters()
                    if p.requires_grad)
    assert 0 <= int(total) - trainable < 64 * torch.distributed.get_world_size(), \
        f"the master partitions hold {int(total)} values for {trainable} trainable ones"


def _ds_outside_write(ds) -> None:
    """DeepSpeed's own way to write a master weight from outside the optimizer (safe_set_full_fp32_param; a
    write into the model is overwritten from the masters at the next step): the written value, bf16 so that
    the bf16 master partition holds it exactly, is the master from then on."""
    from deepspeed.utils import safe_set_full_fp32_param

    name, p = max(((n, q) for n, q in ds.module.named_parameters() if q.requires_grad),
                  key=lambda item: item[1].ds_numel if hasattr(item[1], "ds_numel") else item[1].numel())
    shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
    value = torch.randn(shape, generator=torch.Generator().manual_seed(7)).bfloat16().float()
    safe_set_full_fp32_param(p, value)
    got = _ds_masters(ds)[name]
    assert torch.equal(got, value), \
        f"{name}: master after safe_set_full_fp32_param is {(got - value).abs().max().item():.3g} off the written value"


def _ds_job(rank: int, world: int, root: str) -> dict:
    from test_deepspeed import _setup_rank

    from flashdist.integrations import deepspeed as fds

    _setup_rank(rank, world)
    out = {}
    for engine in DS_ENGINES:
        for name in OPTIMIZERS:
            if refused(cell_id("deepspeed", engine, name, "train")):  # (FlashMuon: DeepSpeed cannot run it)
                continue
            results = {}
            ds = _ds_engine(engine, name)
            _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, ds.basic_optimizer,
                     ds.module)
            _ds_train(ds, 0)
            _attempt(results, "train", _ds_state_only_for_partitions, ds)
            path = f"{root}/{engine}-{name}"
            ds.save_checkpoint(path, tag="saved")
            live = _ds_masters(ds)
            _ds_train(ds, STEPS)
            uninterrupted = _ds_snapshot(ds)

            resumed = {}

            def resume():
                resumed["ds"] = ds2 = _ds_engine(engine, name)
                fds.load_checkpoint(ds2, path, tag="saved")
                _ds_train(ds2, STEPS)
                assert_resume_exact(uninterrupted, _ds_snapshot(ds2), f"DeepSpeed {engine} on 2 ranks")

            _attempt(results, "resume-same", resume)
            # on the resumed engine: a load links DeepSpeed's parameters to the partitions again
            _attempt(results, "outside-write", _ds_outside_write, resumed.get("ds", ds))
            masters = {k[len("master:"):]: v for k, v in uninterrupted.items() if k.startswith("master:")}
            out[(engine, name)] = dict(results=results, live=live, masters=masters, path=path)
    return out


def _ds_universal_job(rank: int, world: int, root: str) -> dict:
    """The Adam checkpoints of _ds_job, made universal, resumed on ``world`` ranks: the masters after STEPS."""
    from test_deepspeed import _setup_rank

    from flashdist.integrations import deepspeed as fds

    _setup_rank(rank, world)
    out = {}
    for engine in DS_ENGINES:
        for name in DS_UNIVERSAL:
            try:
                ds = _ds_engine(engine, name, universal=True)
                fds.load_checkpoint(ds, f"{root}/{engine}-{name}")
                _ds_train(ds, STEPS)
                out[(engine, name)] = _ds_masters(ds)
            except Exception:  # noqa: BLE001 - recorded for the cell
                out[(engine, name)] = traceback.format_exc(limit=-6)
    return out


def run_deepspeed(tmp: Path) -> dict[tuple, dict]:
    """Every optimizer under ZeRO-2 and ZeRO-3 in one spawn of 2 ranks; the Adam checkpoints made universal
    and resumed on 1 rank in a second; the CLI on each checkpoint folder."""
    from flashdist._compat import HAS_DEEPSPEED

    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    from flashdist.integrations import deepspeed as fds

    saved = run_ranks(_ds_job, 2, str(tmp), timeout=600)
    runs = {key: run["results"] for key, run in saved[0].items()}
    for key, run in saved[1].items():  # a stage fails if it failed on either rank
        for stage, failure in run["results"].items():
            runs[key][stage] = runs[key][stage] or failure
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # as the ranks run (tests/test_deepspeed.py)
        for name in DS_UNIVERSAL:
            for engine in DS_ENGINES:
                fds.to_universal(saved[0][(engine, name)]["path"], tag="saved")
    other = run_ranks(_ds_universal_job, 1, str(tmp), timeout=600)[0]
    for (engine, name), run in saved[0].items():
        results, path = runs[(engine, name)], Path(run["path"])
        if name in DS_UNIVERSAL:
            resumed = other[(engine, name)]

            def resume_other():
                assert not isinstance(resumed, str), resumed
                assert_resume_exact(run["masters"], resumed, f"DeepSpeed {engine}, universal checkpoint 2 -> 1")

            _attempt(results, "resume-other", resume_other)
        _check_torch_save_file(results, path, run["live"], tmp / f"out-{engine}-{name}")
    return runs


# ----- Accelerate and the Trainer under FSDP2 on 2 gloo ranks: the optimizer built on the unsharded model -----


def _launch_env(rank: int, world: int) -> None:
    """What a launcher sets, read by Accelerate's state (the process group itself is the harness's)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _assert_nothing_full_size(opt, model) -> None:
    """Under FSDP2 built on the unsharded model, after the client's prepare and before the first step: no state
    (as AdamW), and every tensor the optimizer refers to is the sharded DTensor, none the unsharded parameter
    (which a reference would keep alive: 2 bytes per full-model parameter on every rank)."""
    assert_memory_before_first_step_within_adamw(opt, model)
    held = [p for g in opt.param_groups for p in g["params"]] + list(opt.state)
    full = [tuple(p.shape) for p in held if not D.is_dtensor(p)]
    assert not full, f"{type(opt).__name__} refers to {len(full)} unsharded tensors before the first step: {full[:3]}"


def _accelerate_fsdp_build(name: str):
    from test_accelerate_fsdp2 import _accelerator

    accelerator = _accelerator()
    model = _plain_model()
    opt = OPTIMIZERS[name].build(model)  # before prepare, as the Trainer does
    model, prepared = accelerator.prepare(model, opt)
    return accelerator, model, prepared, opt


def _accelerate_fsdp_job(rank: int, world: int, root: str, resume_only: bool) -> dict:
    _launch_env(rank, world)
    out = {}
    for name in OPTIMIZERS:
        folder = f"{root}/accelerate-{name}"
        if resume_only:  # another world size: Accelerate's load_state of the 2-rank folder
            accelerator, model, prepared, opt = _accelerate_fsdp_build(name)
            accelerator.load_state(folder)
            _plain_train(model, prepared, STEPS)
            out[name] = snapshot(model, opt)
            continue
        results = {}
        accelerator, model, prepared, opt = _accelerate_fsdp_build(name)
        _attempt(results, "first-step-memory", _assert_nothing_full_size, opt, model)
        _plain_train(model, prepared, 0)
        _attempt(results, "train", assert_state_only_for_trainable, opt)
        accelerator.save_state(folder)
        live = live_masters(model, opt)
        _plain_train(model, prepared, STEPS)
        uninterrupted = snapshot(model, opt)

        def resume():
            accelerator2, model2, prepared2, opt2 = _accelerate_fsdp_build(name)
            accelerator2.load_state(folder)
            _plain_train(model2, prepared2, STEPS)
            assert_resume_exact(uninterrupted, snapshot(model2, opt2), "Accelerate FSDP2 on 2 ranks")

        _attempt(results, "resume-same", resume)
        _attempt(results, "outside-write", _outside_write, opt, model)
        out[name] = dict(results=results, live=live, uninterrupted=uninterrupted, path=folder)
    return out


def _merge_ranks(ranks: list[dict]) -> dict[str, dict]:
    """Rank 0's runs, each stage failed if it failed on any rank."""
    runs = {name: dict(run) for name, run in ranks[0].items()}
    for other in ranks[1:]:
        for name, run in other.items():
            runs[name]["results"] = {stage: runs[name]["results"].get(stage) or failure
                                     for stage, failure in run["results"].items()}
    return runs


def run_accelerate_fsdp2(tmp: Path) -> dict[str, dict]:
    pytest.importorskip("accelerate")
    runs = _merge_ranks(run_ranks(_accelerate_fsdp_job, 2, str(tmp), False, timeout=600))
    other = run_ranks(_accelerate_fsdp_job, 1, str(tmp), True, timeout=600)[0]
    out = {}
    for name, run in runs.items():
        results = run["results"]
        _attempt(results, "resume-other", assert_resume_exact, run["uninterrupted"], other[name],
                 "Accelerate FSDP2, 2 -> 1 rank")
        _check_torch_save_file(results, Path(run["path"]), run["live"], tmp / f"out-{name}")
        out[name] = results
    return out


def _trainer_fsdp(name: str, out: str, callbacks=()):
    """The Trainer with ``optim=`` the flashdist name of ``name``, switched to FSDP2 as a GPU launch would have
    it (tests/integrations/test_hf_trainer_fsdp2.py: Accelerate refuses FSDP on a CPU launch)."""
    import transformers
    from _tiny_llama import tiny_llama
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from test_hf_trainer import _data

    import flashdist.integrations.transformers as fd_hf

    fd_hf.register(deepspeed=False)
    entry = OPTIMIZERS[name]
    extra = {k: v for k, v in entry.kwargs.items() if k not in ("lr", "weight_decay")}
    args = transformers.TrainingArguments(
        output_dir=out, optim={cls: key for key, cls in fd_hf.OPTIMIZERS.items()}[name],
        optim_args=",".join(f"{k}={v}" for k, v in extra.items()), learning_rate=entry.kwargs["lr"],
        weight_decay=entry.kwargs.get("weight_decay", 0.0), max_steps=2 * STEPS, save_steps=STEPS,
        per_device_train_batch_size=4, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        logging_strategy="no", max_grad_norm=0.0)  # (no clipping: the sharded norms add up in another order)
    class SaveOnce(transformers.TrainerCallback):  # the checkpoint the cells read, no other (time)
        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step == STEPS

    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=_data(),
                                   callbacks=[*callbacks, SaveOnce()])
    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=False)
    trainer.is_fsdp_enabled = True
    return trainer


def _trainer_fsdp_job(rank: int, world: int, root: str, resume_only: bool) -> dict:
    import transformers

    _launch_env(rank, world)
    out = {}
    for name in OPTIMIZERS:
        ckpt = f"{root}/trainer-{name}/checkpoint-{STEPS}"
        if resume_only:  # another world size: the Trainer's own resume of the 2-rank checkpoint
            resumed = _trainer_fsdp(name, f"{root}/resumed-{world}-{name}")
            resumed.train(resume_from_checkpoint=ckpt)
            out[name] = snapshot(resumed.model, resumed.optimizer.optimizer)
            continue
        results, seen = {}, {}

        class Watch(transformers.TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
                _attempt(results, "first-step-memory", _assert_nothing_full_size, optimizer.optimizer, model)

            def on_save(self, args, state, control, model=None, optimizer=None, **kw):
                if state.global_step == STEPS:
                    seen["live"] = live_masters(model, optimizer.optimizer)

        full = _trainer_fsdp(name, f"{root}/trainer-{name}", [Watch()])
        full.train()
        opt = full.optimizer.optimizer
        _attempt(results, "train", assert_state_only_for_trainable, opt)
        uninterrupted = snapshot(full.model, opt)

        def resume():
            resumed = _trainer_fsdp(name, f"{root}/resumed-{name}")
            resumed.train(resume_from_checkpoint=ckpt)
            assert_resume_exact(uninterrupted, snapshot(resumed.model, resumed.optimizer.optimizer),
                                "Trainer FSDP2 on 2 ranks")

        _attempt(results, "resume-same", resume)
        _attempt(results, "outside-write", _outside_write, opt, full.model)
        out[name] = dict(results=results, live=seen["live"], uninterrupted=uninterrupted, path=ckpt)
    return out


def run_trainer_fsdp2(tmp: Path) -> dict[str, dict]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from _tiny_llama import tiny_llama

    runs = _merge_ranks(run_ranks(_trainer_fsdp_job, 2, str(tmp), False, timeout=600))
    other = run_ranks(_trainer_fsdp_job, 1, str(tmp), True, timeout=600)[0]
    tiny_llama().config.save_pretrained(tmp / "config")  # the checkpoint folder has no config.json under FSDP
    out = {}
    for name, run in runs.items():
        results, ckpt = run["results"], Path(run["path"])
        _attempt(results, "resume-other", assert_resume_exact, run["uninterrupted"], other[name],
                 "Trainer FSDP2, 2 -> 1 rank")
        _check_torch_save_file(results, ckpt, run["live"], tmp / f"out-{name}")
        _attempt(results, "export-hf", _export_hf, ckpt, tmp / f"hf-{name}", run["live"],
                 tmp / "config" / "config.json")
        out[name] = results
    return out


# ----- the Trainer and Accelerate driving DeepSpeed ZeRO-2 and ZeRO-3, 2 gloo ranks, one spawn -----------------

DS_CLIENT_OPTIMIZER = "FlashAdamW"  # the clients hand the config's "type" to flashdist alike for every class


def _ds_client_config(engine: str, client: str, universal: bool = False) -> dict:
    """The Trainer: "auto" values filled from its arguments, fp32 (its bf16 needs a GPU, and use_cpu turns
    DeepSpeed off: fp32 master partitions, no rho); Accelerate: the deepspeed/* cells' bf16 masters + rho."""
    if client == "accelerate":
        return _ds_config(engine, DS_CLIENT_OPTIMIZER, universal)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "steps_per_print": 10 ** 9, "zero_optimization": {"stage": DS_ENGINES[engine]},
              "bf16": {"enabled": False}, "gradient_clipping": "auto",
              "optimizer": {"type": DS_CLIENT_OPTIMIZER, "params": {"lr": "auto", "weight_decay": "auto"}}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _ds_trainer(engine: str, out: str, callbacks=(), universal: bool = False):
    import transformers
    from _tiny_llama import tiny_llama
    from accelerate.state import AcceleratorState
    from test_hf_trainer import _data

    AcceleratorState._reset_state(True)
    kwargs = OPTIMIZERS[DS_CLIENT_OPTIMIZER].kwargs
    args = transformers.TrainingArguments(
        output_dir=out, deepspeed=_ds_client_config(engine, "trainer", universal), learning_rate=kwargs["lr"],
        weight_decay=kwargs["weight_decay"], max_steps=2 * STEPS, per_device_train_batch_size=4, report_to=[],
        seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no", save_strategy="no")

    class SaveOnce(transformers.TrainerCallback):  # the checkpoint the cells read, no other (time)
        def on_step_end(self, args, state, control, **kw):
            control.should_save = state.global_step == STEPS

    return transformers.Trainer(model=tiny_llama(torch.float32), args=args, train_dataset=_data(16),
                                callbacks=[*callbacks, SaveOnce()])


def _ds_trainer_run(engine: str, root: str) -> dict:
    import transformers

    results, seen, holder = {}, {}, {}

    class Watch(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ds = holder["trainer"].model_wrapped
            _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw,
                     ds.basic_optimizer, ds.module)

        def on_save(self, args, state, control, **kw):
            if state.global_step == STEPS:
                seen["live"] = _ds_masters(holder["trainer"].model_wrapped)

    holder["trainer"] = full = _ds_trainer(engine, f"{root}/trainer-{engine}", [Watch()])
    full.train()
    _attempt(results, "train", _ds_state_only_for_partitions, full.model_wrapped)
    uninterrupted = _ds_snapshot(full.model_wrapped)
    ckpt = f"{root}/trainer-{engine}/checkpoint-{STEPS}"
    resumed = {}

    def resume():
        resumed["trainer"] = again = _ds_trainer(engine, f"{root}/trainer-resumed-{engine}")
        again.train(resume_from_checkpoint=ckpt)
        assert_resume_exact(uninterrupted, _ds_snapshot(again.model_wrapped), f"Trainer DeepSpeed {engine}, 2 ranks")

    _attempt(results, "resume-same", resume)
    _attempt(results, "outside-write", _ds_outside_write, resumed.get("trainer", full).model_wrapped)
    return dict(results=results, live=seen.get("live"), path=ckpt)


def _ds_accelerate_build(engine: str, universal: bool = False):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    AcceleratorState._reset_state(True)
    config = _ds_client_config(engine, "accelerate", universal)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _ds_model()
    ds, prepared = accelerator.prepare(model, DummyOptim(model.parameters()))
    return accelerator, ds, prepared


def _ds_accelerate_train(accelerator, ds, prepared, first: int, n: int = STEPS) -> None:
    """As _ds_train, through Accelerate's backward and the prepared optimizer."""
    for step in range(first, first + n):
        x = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(step))
        accelerator.backward(torch.nn.functional.cross_entropy(ds(x).float(), (7 * x + 3) % 64))
        prepared.step()
        prepared.zero_grad()


def _ds_accelerate_run(engine: str, root: str) -> dict:
    results = {}
    accelerator, ds, prepared = _ds_accelerate_build(engine)
    _attempt(results, "first-step-memory", assert_memory_before_first_step_within_adamw, ds.basic_optimizer,
             ds.module)
    _ds_accelerate_train(accelerator, ds, prepared, 0)
    _attempt(results, "train", _ds_state_only_for_partitions, ds)
    folder = f"{root}/accelerate-{engine}"
    accelerator.save_state(folder)
    live = _ds_masters(ds)
    _ds_accelerate_train(accelerator, ds, prepared, STEPS)
    uninterrupted = _ds_snapshot(ds)
    resumed = {}

    def resume():
        accelerator2, resumed["ds"], prepared2 = _ds_accelerate_build(engine)
        accelerator2.load_state(folder)
        _ds_accelerate_train(accelerator2, resumed["ds"], prepared2, STEPS)
        assert_resume_exact(uninterrupted, _ds_snapshot(resumed["ds"]), f"Accelerate DeepSpeed {engine}, 2 ranks")

    _attempt(results, "resume-same", resume)
    _attempt(results, "outside-write", _ds_outside_write, resumed.get("ds", ds))
    masters = {k[len("master:"):]: v for k, v in uninterrupted.items() if k.startswith("master:")}
    return dict(results=results, live=live, masters=masters, path=folder)


def _ds_universal_clients_job(rank: int, world: int, root: str) -> dict:
    """The universal checkpoints made from the 2-rank folders, loaded on ``world`` ranks by the client: for
    Accelerate (load_state) the masters after STEPS more steps; for the Trainer (resume_from_checkpoint: each
    rank trains on its own rows, which another world size sums in another order) the masters as loaded."""
    import transformers
    from test_deepspeed import _setup_rank

    from flashdist.integrations import deepspeed as fds

    _setup_rank(rank, world)
    _launch_env(rank, world)
    fds.register()
    out = {}
    for engine in DS_ENGINES:
        try:
            accelerator, ds, prepared = _ds_accelerate_build(engine, universal=True)
            accelerator.load_state(f"{root}/accelerate-{engine}-universal")
            _ds_accelerate_train(accelerator, ds, prepared, STEPS)
            out[("accelerate", engine)] = _ds_masters(ds)
        except Exception:  # noqa: BLE001 - recorded for the cell
            out[("accelerate", engine)] = traceback.format_exc(limit=-6)
        holder = {}

        class Loaded(transformers.TrainerCallback):  # after the Trainer's load, before its first step
            def on_train_begin(self, args, state, control, **kw):
                out[("trainer", engine)] = _ds_masters(holder["trainer"].model_wrapped)

        try:
            holder["trainer"] = _ds_trainer(engine, f"{root}/trainer-universal-{engine}", [Loaded()], universal=True)
            holder["trainer"].train(resume_from_checkpoint=f"{root}/trainer-{engine}/checkpoint-{STEPS}")
        except Exception:  # noqa: BLE001 - recorded for the cell
            out[("trainer", engine)] = traceback.format_exc(limit=-6)
    return out


def _ds_clients_job(rank: int, world: int, root: str) -> dict:
    from test_deepspeed import _setup_rank

    from flashdist.integrations import deepspeed as fds

    _setup_rank(rank, world)
    _launch_env(rank, world)
    fds.register()  # the clients call deepspeed.initialize themselves
    out = {}
    for engine in DS_ENGINES:
        out[("trainer", engine)] = _ds_trainer_run(engine, root)
        out[("accelerate", engine)] = _ds_accelerate_run(engine, root)
    return out


def run_deepspeed_clients(tmp: Path) -> dict[tuple, dict]:
    """The Trainer and Accelerate under ZeRO-2 and ZeRO-3 with FlashAdamW, all in one spawn of 2 ranks; the
    CLI on the folder each client writes."""
    from flashdist._compat import HAS_DEEPSPEED

    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flashdist.integrations import deepspeed as fds

    runs = _merge_ranks(run_ranks(_ds_clients_job, 2, str(tmp), timeout=600))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # as the ranks run (tests/test_deepspeed.py)
        for (client, engine), run in runs.items():  # the folders as the client wrote them
            results, path = run["results"], Path(run["path"])
            _check_torch_save_file(results, path, run["live"], tmp / f"out-{client}-{engine}")
            if client == "trainer":
                _attempt(results, "export-hf", _export_hf, path, tmp / f"hf-{engine}", run["live"],
                         path / "config.json")
                fds.to_universal(str(path))  # beside global_stepN, where the Trainer's resume looks
            else:  # Accelerate loads its own tag ("pytorch_model"): the universal one goes into a folder of its own
                (tmp / f"accelerate-{engine}-universal").mkdir()
                fds.to_universal(str(path), tag="pytorch_model",
                                 output_dir=str(tmp / f"accelerate-{engine}-universal" / "pytorch_model"))
    other = run_ranks(_ds_universal_clients_job, 1, str(tmp), timeout=600)[0]
    out = {}
    for (client, engine), run in runs.items():
        results, resumed = run["results"], other[(client, engine)]
        want = run["masters"] if client == "accelerate" else run["live"]

        def resume_other():
            assert not isinstance(resumed, str), resumed
            assert_resume_exact(want, resumed, f"{client} DeepSpeed {engine}, universal checkpoint 2 -> 1 rank")

        _attempt(results, "resume-other", resume_other)
        out[(client, engine, DS_CLIENT_OPTIMIZER)] = results
    return out


# ----- the cells ----------------------------------------------------------------------------------------------

_RUNS: dict[tuple, dict] = {}
_PROBED = {"lightning": ("export-fp32", "inspect"),  # refused cells whose one-process run checks the one-line refusal
           "peft-trainer": ("save", "export-fp32", "inspect"), "peft-trainer-bf16": ("save", "export-fp32", "inspect")}


def _results(client: str, engine: str, name: str, tmp_factory) -> dict:
    key = (client, engine) if (client, engine) in (("plain", "ddp"), ("plain", "fsdp2"), ("torchtitan", "fsdp2"),
                                                   ("accelerate", "fsdp2"), ("trainer", "fsdp2")) \
        else (client,) if client == "deepspeed" else ("ds-clients",) if engine in DS_ENGINES \
        else (client, engine, name)
    if key not in _RUNS:
        tmp = tmp_factory.mktemp("-".join(key))
        if client == "deepspeed":
            _RUNS[key] = run_deepspeed(tmp)
        elif key == ("ds-clients",):
            _RUNS[key] = run_deepspeed_clients(tmp)
        elif client == "plain" and engine == "one-process":
            _RUNS[key] = run_plain_one_process(name, tmp)
        elif client == "plain":
            _RUNS[key] = run_plain_multi_rank(engine, tmp)
        elif (client, engine) == ("accelerate", "fsdp2"):
            _RUNS[key] = run_accelerate_fsdp2(tmp)
        elif (client, engine) == ("trainer", "fsdp2"):
            _RUNS[key] = run_trainer_fsdp2(tmp)
        elif client == "torchtitan":
            _RUNS[key] = run_torchtitan(tmp)
        elif client in ("trainer", "peft-trainer", "peft-trainer-bf16"):
            _RUNS[key] = _trainer_run(name, tmp, client)
        elif client == "accelerate":
            _RUNS[key] = run_accelerate(name, tmp)
        elif client == "lightning":
            _RUNS[key] = run_lightning(name, tmp)
    runs = _RUNS[key]
    if key == ("ds-clients",):
        return runs[(client, engine, name)]
    return runs[(engine, name)] if len(key) == 1 else runs[name] if len(key) == 2 else runs


def _param(cell):
    cid = cell_id(*cell)
    marks = []
    reason = expected_failure(cid)
    if reason:
        marks.append(pytest.mark.xfail(strict=True, reason=reason, raises=StageFailure))
    return pytest.param(*cell, id=cid.replace("/", "-"), marks=marks)


@pytest.mark.parametrize("client, engine, optimizer, stage", [_param(c) for c in CELLS])
def test_cell(client, engine, optimizer, stage, tmp_path_factory):
    reason = refused(cell_id(client, engine, optimizer, stage))
    probed = stage in _PROBED.get(client, ()) and engine == "one-process"
    results = _results(client, engine, optimizer, tmp_path_factory) if not reason or probed else None
    if results is None:  # refused: the refusal is the user's to read
        assert refusal_documented(cell_id(client, engine, optimizer, stage)), \
            f"refused ({reason}), but not in {DOCS.name}'s table of cells that are not paths: add it there"
        return
    assert stage in results, f"the {client}/{engine} run has no {stage} stage: add it, or list the cell as refused"
    if results[stage] is not None:
        raise StageFailure(results[stage])


def test_refused_cells_are_the_documented_ones():
    """Every REFUSED pattern is covered by a row of the docs' table, and every documented pattern by REFUSED."""
    documented = [pattern for pattern, _ in documented_patterns()]
    missing = [k for k in REFUSED if not any(fnmatch.fnmatchcase(k, d) for d in documented)]
    stale = [d for d in documented if not any(fnmatch.fnmatchcase(k, d) or fnmatch.fnmatchcase(d, k)
                                              for k in REFUSED)]
    assert not missing, f"REFUSED cells not in docs/integrations.md's table: {missing}"
    assert not stale, f"docs/integrations.md lists refused cells that REFUSED does not have: {stale}"
