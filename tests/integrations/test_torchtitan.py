"""torchtitan 0.3.0: flashdist optimizers built from a torchtitan optimizer config, stepped through
torchtitan's OptimizersContainer and LR schedulers, saved and resumed by torchtitan's CheckpointManager (DCP)
under FSDP2 on gloo ranks. A resumed run must equal the run that never stopped, bit for bit, at the same
world size and at another one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan", reason="the torchtitan integration is tested against torchtitan itself")

from harness import run_ranks  # noqa: E402
from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from flashdist import FlashAdamW, FlashLion  # noqa: E402
from flashdist import distributed as D  # noqa: E402
from flashdist.integrations.torchtitan import FLASH_OPTIMIZERS, HELPERS, FlashOptimizersContainer, flash_adamw  # noqa: E402

STEPS_BEFORE, STEPS_AFTER = 2, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(40, 7)  # 7 rows: uneven shards on 2 ranks
        self.out = nn.Linear(7, 3)
        self.norm = nn.Parameter(torch.ones(3))


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16)


def _config(fmt: str) -> FlashOptimizersContainer.Config:
    # Two flashdist optimizers and torch's AdamW in one container (torchtitan batches groups by name).
    return FlashOptimizersContainer.Config(state_dict_format=fmt, implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r"^out\.", optimizer_name="FlashLion",
                         optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}),
        ParamGroupConfig(pattern=r"^norm$", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
        ParamGroupConfig(pattern=r"bias", optimizer_name="FlashAdamW",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="FlashAdamW",
                         optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}),
    ])


def test_config_builds_flashdist_optimizers():
    model = _model()
    container = _config("compressed").build(model_parts=[model])
    kinds = sorted(type(o).__name__ for o in container)
    assert kinds == ["AdamW", "FlashAdamW", "FlashLion"]
    adamw = next(o for o in container if isinstance(o, FlashAdamW))
    assert adamw.state_dict_format == "compressed"
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.0, 0.1]
    for o in container:  # torch's fused/foreach switches reach torch's optimizers only
        assert all(("foreach" in g) == isinstance(o, torch.optim.AdamW) for g in o.param_groups)
    adamw.ensure_state(model.proj.weight)  # (state is made at the first step, or by ensure_state)
    state = adamw.state[model.proj.weight]
    assert state["exp_avg_codes"].dtype == torch.int8 and state["rho"].dtype == torch.int8
    # one step through the container moves every trainable parameter
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    container.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # how a flashdist step runs is not saved (a checkpoint of an earlier version, which has no such key, loads);
    # torch's AdamW keeps its own
    sd = container.state_dict()
    assert not any(k.endswith(".capturable") and "norm" not in k for k in sd)
    assert any(k.endswith(".capturable") for k in sd if "norm" in k)


def test_flash_adamw_defaults_and_per_name_options():
    model = _model()
    config = flash_adamw(lr=3e-4, master_weight_bits=32)
    config.optimizer_factory_kwargs_by_name = {"FlashAdamW": {"state_dict_format": "portable"}}
    (opt,) = list(config.build(model_parts=[model]))
    assert isinstance(opt, FlashAdamW) and opt.state_dict_format == "portable"
    group = opt.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"]) == (3e-4, (0.9, 0.95), 0.1)
    opt.ensure_state(model.proj.weight)  # (state is made at the first step, or by ensure_state)
    assert opt.state[model.proj.weight]["rho"].dtype == torch.int16


@pytest.mark.parametrize("name", FLASH_OPTIMIZERS)
def test_every_flashdist_name_has_a_one_group_helper_that_builds_and_steps(name):
    model = _model()
    (opt,) = list(HELPERS[name](state_dict_format="portable").build(model_parts=[model]))
    assert type(opt) is FLASH_OPTIMIZERS[name] and opt.state_dict_format == "portable"
    assert len(opt.param_groups) == (2 if name == "FlashMuon" else 1)
    assert all("foreach" not in group for group in opt.param_groups)
    before = model.proj.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(before, model.proj.weight)


@pytest.mark.parametrize("name, match", [("Flashadamw", "did you mean 'FlashAdamW'"), ("SGD9", "valid names")])
def test_misspelt_name_is_refused_with_the_valid_names(name, match):
    config = flash_adamw()
    config.param_groups[0].optimizer_name = name
    with pytest.raises(ValueError, match=match) as info:
        config.build(model_parts=[_model()])
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in (*FLASH_OPTIMIZERS, "AdamW"))


@pytest.mark.parametrize("name, left", [("FlashSGD", "betas, eps"), ("FlashSGDW", "betas, eps"), ("FlashLion", "eps")])
def test_switching_the_name_refuses_the_options_left_from_adam(name, left):
    """flash_adamw's config with only the name switched (as `--optimizer...optimizer_name FlashSGD` would):
    Adam's betas and eps would sit unused in the group; they are named instead."""
    config = flash_adamw()
    config.param_groups[0].optimizer_name = name
    with pytest.raises(ValueError, match=f"sets {left}, which {name} does not take") as info:
        config.build(model_parts=[_model()])
    assert "\n" not in str(info.value)


def test_optimizer_wide_option_in_a_group_is_refused_with_where_it_goes():
    config = flash_adamw(graphed=True)
    with pytest.raises(ValueError, match=r"graphed apply to the whole optimizer.*optimizer_factory_kwargs_by_name"):
        config.build(model_parts=[_model()])


@pytest.mark.parametrize("field,value", [("state_dict_format", "fp32"), ("backend", "cuda")])
def test_bad_option_is_one_line_error(field, value):
    with pytest.raises(ValueError, match=f"optimizer.{field}") as info:
        FlashOptimizersContainer.Config(**{field: value})
    assert "\n" not in str(info.value)


# ----- checkpoints through torchtitan's CheckpointManager, FSDP2 on gloo ranks --------------------------------


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(p.shape, generator=g).to(torch.bfloat16) for name, p in _model().named_parameters()}


def _setup(fmt: str, folder: str, seed: int):
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    model = _model(seed)
    fully_shard(model.proj)
    fully_shard(model)
    container = _config(fmt).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=container, training_steps=10)
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1).build(
        dataloader=None, model_parts=[model], optimizers=container, lr_schedulers=schedulers, states={},
        sd_adapter=None, base_folder=folder)
    return model, container, schedulers, manager


def _train(model, container, schedulers, first: int, n: int):
    params = dict(model.named_parameters())
    for step in range(first, first + n):
        for name, full in _grads(step).items():
            p = params[name]
            p.grad = D.state_like(p, D.local_rows(full, p).clone(), tuple(full.shape))
        container.step()
        schedulers.step()
        container.zero_grad()


def _gather(model, container) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = D.full_tensor(p.detach()).clone()
        for opt in container:
            for key, value in opt.state.get(p, {}).items():
                out[f"{name}:{key}"] = D.full_tensor(value).clone()
    return out


def _save_and_continue(rank, world_size, fmt, folder):
    model, container, schedulers, manager = _setup(fmt, folder, seed=0)
    _train(model, container, schedulers, 0, STEPS_BEFORE)
    manager.save(curr_step=STEPS_BEFORE)
    manager.close()
    _train(model, container, schedulers, STEPS_BEFORE, STEPS_AFTER)
    return _gather(model, container)


def _resume(rank, world_size, fmt, folder):
    model, container, schedulers, manager = _setup(fmt, folder, seed=1)  # other weights: the load must set them
    assert manager.load(step=STEPS_BEFORE)
    manager.close()
    _train(model, container, schedulers, STEPS_BEFORE, STEPS_AFTER)
    return _gather(model, container)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed", "portable"])
def test_checkpoint_manager_resume_is_exact(tmp_path, fmt):
    uninterrupted = run_ranks(_save_and_continue, 2, fmt, str(tmp_path))[0]
    for world_size in (2, 3, 1):  # same world size, then others (DCP reshards the saved shards)
        resumed = run_ranks(_resume, world_size, fmt, str(tmp_path))[0]
        assert resumed.keys() == uninterrupted.keys()
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), f"{key} differs after resuming on {world_size} ranks"
    assert uninterrupted["proj.weight:exp_avg_codes"].dtype == torch.int8  # the state stayed quantized


def test_job_config_and_command_line_reach_the_container(tmp_path, monkeypatch):
    # torchtitan's own config loading: --module names a package with a config_registry, and command-line
    # overrides reach the fields of FlashOptimizersContainer.Config.
    from torchtitan.config import ConfigManager

    package = tmp_path / "flash_job_config"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(
        "from torchtitan.trainer import Trainer\n"
        "from flashdist.integrations.torchtitan import flash_adamw\n\n"
        "def tiny_flash():\n"
        "    return Trainer.Config(optimizer=flash_adamw(lr=1e-3, master_weight_bits=32))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", "flash_job_config", "--config", "tiny_flash",
                                         "--optimizer.state_dict_format", "portable"])
    assert isinstance(config.optimizer, FlashOptimizersContainer.Config)
    assert config.optimizer.state_dict_format == "portable"
    (opt,) = list(config.optimizer.build(model_parts=[_model()]))
    assert isinstance(opt, FlashAdamW) and opt.state_dict_format == "portable"
    assert opt.param_groups[0]["master_weight_bits"] == 32


def test_name_switched_on_the_command_line_refuses_adams_options(tmp_path, monkeypatch):
    """torchtitan's ConfigManager: `--optimizer.param-groups.0.optimizer-name FlashSGD` on a flash_adamw config
    keeps Adam's betas and eps in the group; building the container names them instead of ignoring them.
    A misspelt name gets the valid names."""
    from torchtitan.config import ConfigManager

    package = tmp_path / "flash_switch_config"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(
        "from torchtitan.trainer import Trainer\n"
        "from flashdist.integrations.torchtitan import flash_adamw\n\n"
        "def tiny_flash():\n"
        "    return Trainer.Config(optimizer=flash_adamw(lr=1e-3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, match in (("FlashSGD", "sets betas, eps, which FlashSGD does not take"),
                        ("FlashLoin", "did you mean 'FlashLion'")):
        config = ConfigManager().parse_args(["--module", "flash_switch_config", "--config", "tiny_flash",
                                             "--optimizer.param-groups.0.optimizer-name", name])
        assert config.optimizer.param_groups[0].optimizer_name == name
        with pytest.raises(ValueError, match=match):
            config.optimizer.build(model_parts=[_model()])


def test_checkpoint_of_another_model_is_one_line_error():
    model = _model()
    container = _config("compressed").build(model_parts=[model])
    for p in model.parameters():  # one step, so that there is state for a refused load to leave alone
        p.grad = torch.ones_like(p)
    container.step()
    flat = container.state_dict()
    lion = next(o for o in container if isinstance(o, FlashLion))  # loaded before the renamed group's
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum_before = lion.state[model.out.weight]["exp_avg_codes"].clone()
    flat["state.out.weight.exp_avg_codes"] = momentum_before + 1
    renamed = {k.replace("proj.", "encoder."): v for k, v in flat.items()}
    with pytest.raises(ValueError, match="'proj.bias'.*another model") as info:
        container.load_state_dict(renamed)
    assert "\n" not in str(info.value)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(lion.state[model.out.weight]["exp_avg_codes"], momentum_before)
