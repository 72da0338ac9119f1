"""The conformance matrix: every cell of conformance_table.CELLS (client x engine x optimizer x stage) runs
the invariants of conformance_invariants.py, is refused with a reason docs/integrations.md lists (the cell
asserts it is listed), or waits (strict xfail) for the fix of the issue item it names.

Cost: a run per (client, engine, optimizer) does every stage at once and records each stage's outcome; the
cells read those records. The multi-rank engines run every optimizer in one spawn per engine."""

from __future__ import annotations

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
from conformance_invariants import (assert_bitwise_equal, assert_masters_from,
                                    assert_memory_before_first_step_within_adamw, assert_noop_option_says_so_once,
                                    assert_outside_write_is_own_master, assert_resume_exact,
                                    assert_state_only_for_trainable, live_masters, snapshot)
from conformance_table import CELLS, OPTIMIZERS, cell_id, expected_failure, refused
from documented import DOCS, refusal_documented
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
    def step(opt):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()

    assert_noop_option_says_so_once(
        lambda: entry.build([torch.nn.Parameter(torch.zeros(4, 32, dtype=torch.bfloat16))], graphed=True),
        step, "graphed")


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
    opt = entry.build(model.named_parameters())
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
        opt2 = entry.build(model2.named_parameters())
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
        opt = entry.build(model.named_parameters())
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
            opt2 = entry.build(model2.named_parameters())
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
        opt = entry.build(model.named_parameters())
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
            opt2 = entry.build(model2.named_parameters())
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
            opt = entry.build(model.named_parameters())
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
        if client == "peft-trainer":  # PEFT's fp32 adapters: the warning's advice must fit PEFT
            said = [str(w.message) for w in record if "flashdist" in str(w.message) and "fp32" in str(w.message)]
            assert said and all("PEFT" in s and "model.to(torch.bfloat16)" not in s for s in said), said

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
        opt = entry.build(model.named_parameters())
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
            return entry.build(self.named_parameters())

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


# ----- the cells ----------------------------------------------------------------------------------------------

_RUNS: dict[tuple, dict] = {}
_PROBED = {"lightning": ("export-fp32", "inspect"),  # refused cells whose run checks the one-line refusal
           "peft-trainer": ("save", "export-fp32", "inspect"), "peft-trainer-bf16": ("save", "export-fp32", "inspect")}


def _results(client: str, engine: str, name: str, tmp_factory) -> dict:
    key = (client, engine) if (client, engine) in (("plain", "ddp"), ("plain", "fsdp2"), ("torchtitan", "fsdp2")) \
        else (client, engine, name)
    if key not in _RUNS:
        tmp = tmp_factory.mktemp("-".join(key))
        if client == "plain" and engine == "one-process":
            _RUNS[key] = run_plain_one_process(name, tmp)
        elif client == "plain":
            _RUNS[key] = run_plain_multi_rank(engine, tmp)
        elif client == "torchtitan":
            _RUNS[key] = run_torchtitan(tmp)
        elif client in ("trainer", "peft-trainer", "peft-trainer-bf16"):
            _RUNS[key] = _trainer_run(name, tmp, client)
        elif client == "accelerate":
            _RUNS[key] = run_accelerate(name, tmp)
        elif client == "lightning":
            _RUNS[key] = run_lightning(name, tmp)
    runs = _RUNS[key]
    return runs[name] if len(key) == 2 else runs


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
    results = _results(client, engine, optimizer, tmp_path_factory) if not reason or stage in _PROBED.get(
        client, ()) else None
    if results is None:  # refused: the refusal is the user's to read
        assert refusal_documented(cell_id(client, engine, optimizer, stage)), \
            f"refused ({reason}), but not in {DOCS.name}'s table of cells that are not paths: add it there"
        return
    assert stage in results, f"the {client}/{engine} run has no {stage} stage: add it, or list the cell as refused"
    if results[stage] is not None:
        raise StageFailure(results[stage])
