"""flashdist under DeepSpeed ZeRO (flashdist.integrations.deepspeed), on CPU: DS_ACCELERATOR=cpu, gloo.

Three parts: the flat layout DeepSpeed's partitions get (plain optimizer tests, no DeepSpeed needed); the
config section (checked before DeepSpeed starts, no DeepSpeed needed); and ZeRO 1/2/3 training on 2 ranks
in both modes (fp32 master partitions, bf16 master partitions + rho), against DeepSpeed with
torch.optim.AdamW, with exact same-world-size checkpoint round trips, 24-bit masters surviving universal
checkpoints (2 -> 1 and 2 -> 3 ranks) and fp32 export. All DeepSpeed runs of one world size share a
process launch: importing DeepSpeed costs seconds per process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from flashdist import FlashAdamW
from flashdist._compat import HAS_DEEPSPEED
from flashdist.integrations import deepspeed as fds
from flashdist.quant import rho as R

from harness import run_ranks

needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed; launch/setup.sh "
                              "installs it)")

# ----- the flat layout -----------------------------------------------------------------------------------


def _grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 1, (n,), generator=g) for _ in range(steps)]


def _run(p: torch.Tensor, grads, **kwargs) -> FlashAdamW:
    opt = FlashAdamW([p], lr=1e-2, weight_decay=0.1, **kwargs)
    for g in grads:
        p.grad = g.reshape(p.shape).to(p.dtype)
        opt.step()
    return opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flat_layout_is_one_row(dtype):
    """A 1-d tensor under flat_layout steps bit for bit like the same values as ONE row of a 2-d tensor."""
    n = 100  # three full groups and a partial one
    start = torch.randn(n).to(dtype)
    grads = _grads(n, 4)
    flat = start.clone()
    opt_flat = _run(flat, grads, flat_layout=True)
    row = start.clone().reshape(1, n)
    opt_row = _run(row, grads)
    assert torch.equal(flat, row.reshape(n))
    s_flat, s_row = opt_flat.state[flat], opt_row.state[row]
    assert s_flat.keys() == s_row.keys()
    assert s_flat["exp_avg_codes"].shape == (n,) and s_flat["exp_avg_scales"].shape == (1, 4)
    for key in s_flat:
        assert torch.equal(s_flat[key].reshape(-1), s_row[key].reshape(-1)), key


def test_flat_layout_state_is_created_by_the_first_step():
    p = torch.randn(40, dtype=torch.bfloat16)
    opt = FlashAdamW([p], flat_layout=True)
    assert not opt.state and not opt.state_dict()["state"]
    p.grad = torch.randn(40, dtype=torch.bfloat16)
    opt.step()
    assert sorted(opt.state[p]) == ["exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales",
                                    "rho", "step"]


def test_flat_layout_portable_state_dict_round_trips_exactly():
    n = 70
    grads = _grads(n, 6)
    p = torch.randn(n).bfloat16()
    opt = _run(p, grads[:3], flat_layout=True)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32 and sd["state"][0]["exp_avg"].shape == (n,)
    q = p.clone()
    opt2 = FlashAdamW([q], lr=1e-2, weight_decay=0.1, flat_layout=True)
    opt2.load_state_dict(sd)  # before any step: the state is created by the load
    for g in grads[3:]:
        for t, o in ((p, opt), (q, opt2)):
            t.grad = g.to(t.dtype)
            o.step()
    assert torch.equal(p, q)
    for key in opt.state[p]:
        assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_float_moments_written_into_the_state_are_requantized(moment_dtype):
    """DeepSpeed's universal-checkpoint loader writes a plain-number step and float exp_avg/exp_avg_sq of the
    partition's shape straight into optimizer.state; the next step re-quantizes them and drops them."""
    n = 90
    grads = _grads(n, 5)
    p = torch.randn(n)
    opt = _run(p, grads[:3], flat_layout=True)
    sd = opt.state_dict()["state"][0]
    q = p.clone()
    opt2 = FlashAdamW([q], lr=1e-2, weight_decay=0.1, flat_layout=True)
    opt2.state[q] = {"step": int(sd["step"]), "exp_avg": sd["exp_avg"].to(moment_dtype),
                     "exp_avg_sq": sd["exp_avg_sq"].to(moment_dtype)}
    for g in grads[3:]:
        for t, o in ((p, opt), (q, opt2)):
            t.grad = g.clone()
            o.step()
    assert "exp_avg" not in opt2.state[q] and isinstance(opt2.state[q]["step"], torch.Tensor)
    if moment_dtype == torch.float32:  # re-quantizing unchanged portable moments is exact
        assert torch.equal(p, q)
    else:
        torch.testing.assert_close(p, q, rtol=0, atol=1e-3)


def test_flat_layout_must_be_a_bool():
    with pytest.raises(ValueError, match="flat_layout must be True or False"):
        FlashAdamW([torch.zeros(3)], flat_layout="yes")


# ----- the optimizer section of a DeepSpeed config -------------------------------------------------------


def _config(**overrides) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
              "optimizer": {"type": "FlashAdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
    for key, value in overrides.items():
        config[key] = value
    return config


def test_config_builds_the_flashdist_optimizer():
    original = _config()
    config, spec = fds.prepare_config(original)
    assert "optimizer" not in config and config["zero_allow_untested_optimizer"] is True
    assert "optimizer" in original  # the caller's dict is not changed
    assert spec.cls is FlashAdamW
    assert spec.kwargs == {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "flat_layout": True}
    opt = spec([nn.Parameter(torch.zeros(8))])
    assert isinstance(opt, FlashAdamW) and opt.param_groups[0]["flat_layout"] is True


@pytest.mark.parametrize("name", ["flashadam", "flashdist.FlashAdam", "FLASHADAM"])
def test_config_type_names(name):
    from flashdist import FlashAdam

    _, spec = fds.prepare_config(_config(optimizer={"type": name, "params": {"lr": 1e-3}}))
    assert spec.cls is FlashAdam


def test_config_with_a_deepspeed_optimizer_is_left_alone():
    config = _config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    out, spec = fds.prepare_config(config)
    assert spec is None and out is config


@pytest.mark.parametrize("zero", [{"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                                  {"stage": 3, "cpu_offload": True}], ids=["offload_optimizer", "cpu_offload"])
def test_config_with_optimizer_offload_lets_flashdist_step_on_the_cpu(zero):
    config, spec = fds.prepare_config(_config(zero_optimization=zero))
    assert spec.cls is FlashAdamW and config["zero_force_ds_cpu_optimizer"] is False
    assert config["zero_optimization"] == zero
    assert fds.prepare_config(_config())[0].get("zero_force_ds_cpu_optimizer") is None  # no offload: untouched


def test_config_from_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config()))
    config, spec = fds.prepare_config(fds.load_config(str(path)))
    assert spec.cls is FlashAdamW and "optimizer" not in config


BAD_CONFIGS = {
    "unknown-type": (dict(optimizer={"type": "FlashLamb"}), "does not have.*FlashAdam, FlashAdamW"),
    "unknown-flashdist-type": (dict(optimizer={"type": "flashdist.Sophia"}), "does not have"),
    "bad-lr": (dict(optimizer={"type": "FlashAdamW", "params": {"lr": -1.0}}), r"lr must be >= 0.0, got -1.0"),
    "bad-betas": (dict(optimizer={"type": "FlashAdamW", "params": {"betas": [0.9]}}), "betas must be a pair"),
    "bad-bits": (dict(optimizer={"type": "FlashAdamW", "params": {"master_weight_bits": 16}}),
                 "master_weight_bits must be"),
    "unknown-param": (dict(optimizer={"type": "FlashAdamW", "params": {"adam_w_mode": True}}),
                      r"\['adam_w_mode'\], which FlashAdamW does not take"),
    "params-not-object": (dict(optimizer={"type": "FlashAdamW", "params": [1e-3]}), "must be an object"),
    "extra-key": (dict(optimizer={"type": "FlashAdamW", "params": {}, "lr": 1}), "takes only 'type' and 'params'"),
    "flat-layout-off": (dict(optimizer={"type": "FlashAdamW", "params": {"flat_layout": False}}),
                        "always True"),
    "no-zero": (dict(zero_optimization={"stage": 0}), "needs ZeRO"),
    "no-zero-section": (dict(zero_optimization=None), "needs ZeRO"),
    "offload-nvme": (dict(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}}),
                     "device 'cpu', the config has 'nvme'"),
    "offload-forced-ds-cpu-adam": (dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                        zero_force_ds_cpu_optimizer=True), "zero_force_ds_cpu_optimizer: true"),
    "offload-bf16-masters": (dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                  bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                        "bf16_optimizer_states": True}), "only for its own DeepSpeedCPUAdam"),
    "legacy-cpu-offload-bf16-masters": (dict(zero_optimization={"stage": 2, "cpu_offload": True},
                                             bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                                   "bf16_optimizer_states": True}), "DeepSpeedCPUAdam"),
    "bf16-masters-without-states": (dict(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
                                    "bf16_optimizer_states: true"),
    "untested-off": (dict(zero_allow_untested_optimizer=False), "zero_allow_untested_optimizer"),
    "muon": (dict(optimizer={"type": "FlashMuon", "params": {"lr": 0.02}}), "no rank holds the whole matrices"),
}


@pytest.mark.parametrize("overrides, match", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_is_refused_before_deepspeed_starts(overrides, match):
    with pytest.raises(ValueError, match=match):
        fds.prepare_config(_config(**overrides))


@needs_deepspeed
def test_optimizer_argument_and_flashdist_config_are_refused():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="pass one of the two"):
        fds.initialize(model=model, model_parameters=model.parameters(),
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config())


@needs_deepspeed
def test_flashdist_optimizer_instance_is_refused():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    config = {k: v for k, v in _config().items() if k != "optimizer"}
    with pytest.raises(ValueError, match="flat_layout=True"):
        fds.initialize(model=model, optimizer=FlashAdamW(model.parameters()), config=config)
    from flashdist import FlashMuon  # refused for what it is, not with advice that does not fit it

    for optimizer in (FlashMuon([model.weight]), FlashMuon):
        with pytest.raises(ValueError, match="FlashMuon was passed to DeepSpeed, which cannot run it.*FSDP2"):
            fds.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config)


# ----- ZeRO on gloo ranks --------------------------------------------------------------------------------

GLOBAL_BATCH = 24  # 24, 12 and 8 samples per rank on 1, 2 and 3 ranks: the same global batch
VOCAB, DIM = 64, 48
SAVE_AT, AFTER = 5, 3  # steps before the checkpoint, steps after it
STAGES = (1, 2, 3)
MODES = ("fp32-masters", "bf16-masters")


class Net(nn.Module):
    """A tiny language model: nn.Embedding's N(0, 1) weights and LayerNorm's ones are where bf16 rounding
    swallows small updates."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.down(nn.functional.gelu(self.up(self.norm(h)))))


def _config_for(stage: int, mode: str, world: int, *, params=None, optimizer="FlashAdamW", universal=False):
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": optimizer, "params": params or {"lr": 1e-3, "weight_decay": 0.1}}}
    if mode == "bf16-masters":
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _setup_rank(rank: int, world: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    from collections import defaultdict

    import deepspeed.ops

    # DeepSpeed's CPU all-reduce is a C++ extension built on first use (minutes on a fresh 2-core machine)
    # after probing every op's compiler; gloo is enough here, so mark every extension as unavailable.
    deepspeed.ops.__compatible_ops__ = defaultdict(bool)


def _engine(config):
    torch.manual_seed(0)
    model = Net()
    engine, *_ = fds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine, start: int, steps: int) -> list[float]:
    """Global mean losses of steps ``start ..``; rank r takes its slice of each step's global batch."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = GLOBAL_BATCH // world
    losses = []
    for step in range(start, start + steps):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(step))
        y = (7 * x + 3) % VOCAB
        loss = nn.functional.cross_entropy(engine(x[rank * n:(rank + 1) * n]).float(), y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _local_state(engine) -> list[dict]:
    """This rank's master partitions and the flashdist state of each, as copies."""
    out = []
    for master in fds.master_partitions(engine):
        state = engine.basic_optimizer.state.get(master, {})
        out.append({"master": master.detach().clone(),
                    **{k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}})
    return out


def _save_resume_run(config: dict, root: str, key: str) -> dict:
    """Train SAVE_AT steps, save, train AFTER more; a second engine loads the checkpoint and trains the same
    AFTER steps. Losses and this rank's optimizer state of both, and the saved fp32 masters."""
    engine = _engine(config)
    run = {"before": _train(engine, 0, SAVE_AT)}
    engine.save_checkpoint(os.path.join(root, key), tag="saved")
    run["saved_masters"] = fds.fp32_master_weights(engine)
    run["after"] = _train(engine, SAVE_AT, AFTER)
    run["state"] = _local_state(engine)
    resumed = _engine(config)
    fds.load_checkpoint(resumed, os.path.join(root, key), tag="saved")
    run["resumed_after"] = _train(resumed, SAVE_AT, AFTER)
    run["resumed_state"] = _local_state(resumed)
    return run


FAMILY = {"FlashSGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "FlashLion": {"lr": 3e-4, "weight_decay": 0.3}}


def _rank_zero_runs(rank: int, world: int, root: str) -> dict:
    """Every 2-rank DeepSpeed run of this file, in one process launch per rank."""
    _setup_rank(rank, world)
    out = {}
    for stage in STAGES:
        reference = _engine(_config_for(stage, "fp32-masters", world, optimizer="AdamW",
                                        params={"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}))
        out[f"z{stage}-torch-adamw"] = _train(reference, 0, SAVE_AT + AFTER)
        for mode in MODES:
            out[f"z{stage}-{mode}"] = _save_resume_run(_config_for(stage, mode, world), root, f"z{stage}-{mode}")
    # The rest of the family under every stage, bf16 masters + rho: train, save, resume.
    for stage in STAGES:
        for name, params in FAMILY.items():
            config = _config_for(stage, "bf16-masters", world, optimizer=name, params=params)
            out[f"z{stage}-{name}"] = _save_resume_run(config, root, f"z{stage}-{name}")
    # 24-bit masters: bf16 master partitions with rho against fp32 ones, and without rho. A small learning
    # rate against weights of size ~1 (embeddings, norms) is where bf16 rounding loses updates.
    slow = {"lr": 3e-4, "weight_decay": 0.0}
    for key, mode, params in (("fp32-masters", "fp32-masters", slow), ("bf16-masters+rho", "bf16-masters", slow),
                              ("bf16-masters-no-rho", "bf16-masters", dict(slow, master_weight_bits=None))):
        out[f"long/{key}"] = _train(_engine(_config_for(2, mode, world, params=params)), 0, 60)
    return out


def _rank_universal(rank: int, world: int, root: str, stage: int, mode: str) -> dict:
    _setup_rank(rank, world)
    config = _config_for(stage, mode, world, universal=True)
    plain = _engine(config)
    type(plain).load_checkpoint(plain, root)  # DeepSpeed's loader alone: rho is not in a universal checkpoint
    own = _engine(config)
    own.load_checkpoint(root)  # the engine's own call, as Accelerate's load_state and the Trainer's resume make it
    engine = _engine(config)
    fds.load_checkpoint(engine, root)
    return {"plain_masters": fds.fp32_master_weights(plain), "own_masters": fds.fp32_master_weights(own),
            "masters": fds.fp32_master_weights(engine), "after": _train(engine, SAVE_AT, AFTER)}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    root = tmp_path_factory.mktemp("deepspeed")
    results = run_ranks(_rank_zero_runs, 2, str(root), timeout=600)
    return root, results


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_zero_training_tracks_torch_adamw(zero_runs, stage, mode):
    _, results = zero_runs
    run = results[0][f"z{stage}-{mode}"]
    losses = run["before"] + run["after"]
    reference = results[0][f"z{stage}-torch-adamw"]
    assert losses[-1] < losses[0] - 0.1
    # 8-bit moments and (in bf16-master mode) 24-bit masters: the same curve (measured: within 2.2e-4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-3, atol=0)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_save_load_same_world_size_is_exact(zero_runs, stage, mode):
    _, results = zero_runs
    for rank_result in results:
        run = rank_result[f"z{stage}-{mode}"]
        assert run["resumed_after"] == run["after"]
        assert len(run["state"]) == len(run["resumed_state"]) > 0
        for state, resumed in zip(run["state"], run["resumed_state"]):
            assert state.keys() == resumed.keys()
            assert ("rho" in state) == (mode == "bf16-masters")
            assert state["exp_avg_codes"].dtype == torch.int8  # quantized, flat layout
            for key in state:
                assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(resumed[key])), key


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_family_trains_and_resumes_exactly(zero_runs, stage, name):
    """FlashSGD and FlashLion by name in the config, bf16 master partitions + rho: the loss falls, and a
    checkpoint resumes bit for bit."""
    _, results = zero_runs
    for rank_result in results:
        run = rank_result[f"z{stage}-{name}"]
        losses = run["before"] + run["after"]
        assert losses[-1] < losses[0] - 0.05, losses
        assert run["resumed_after"] == run["after"]
        codes = "exp_avg_codes" if name == "FlashLion" else "momentum_buffer_codes"
        for state, resumed in zip(run["state"], run["resumed_state"]):
            assert state.keys() == resumed.keys() and "rho" in state
            assert state[codes].dtype == torch.int8  # quantized, flat layout
            for key in state:
                assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(resumed[key])), key


@needs_deepspeed
def test_universal_conversion_of_a_non_adam_checkpoint_is_refused(zero_runs, tmp_path):
    root, _ = zero_runs
    with pytest.raises(ValueError, match="Adam's moments only"):
        fds.to_universal(os.path.join(str(root), "z2-FlashLion"), str(tmp_path / "out"), tag="saved")
    assert not (tmp_path / "out").exists()


@needs_deepspeed
@pytest.mark.slow
def test_files_hold_only_the_classes_the_reader_allows(zero_runs):
    """Every file engine.save_checkpoint wrote (ZeRO 1/2/3, both modes, the family) pickles no class beyond
    tensors, plain data and deepspeed_files.DEEPSPEED_GLOBALS, so the reader's allow-list is enough (and if a
    DeepSpeed version pickles something new, this says what)."""
    from flashdist.checkpoint.deepspeed_files import DEEPSPEED_GLOBALS

    root, _ = zero_runs
    found = {}
    for path in sorted(root.glob("*/saved/*.pt")):
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(path):
            found.setdefault(name, path.name)
    assert len(list(root.glob("*/saved/*_optim_states.pt"))) == 2 * 3 * (len(MODES) + len(FAMILY))
    assert set(found) <= set(DEEPSPEED_GLOBALS), found
    # all but DynamicLossScaler (fp16 dynamic loss scaling) are in these bf16 runs' files
    assert set(found) == set(DEEPSPEED_GLOBALS) - {"deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"}, found


@needs_deepspeed
@pytest.mark.slow
def test_rho_keeps_bf16_masters_on_the_fp32_curve(zero_runs):
    _, results = zero_runs
    mean = {key: sum(results[0][f"long/{key}"][-10:]) / 10
            for key in ("fp32-masters", "bf16-masters+rho", "bf16-masters-no-rho")}
    with_rho = abs(mean["bf16-masters+rho"] - mean["fp32-masters"])
    without = abs(mean["bf16-masters-no-rho"] - mean["fp32-masters"])
    # measured (mean loss of steps 51-60, lr 3e-4): fp32 masters 3.4840, bf16 + rho 3.4840, bf16 alone 3.7101
    assert with_rho < 0.005 and without > 0.1, mean


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_fp32_export_is_param_plus_rho(zero_runs, stage, mode, monkeypatch):
    root, results = zero_runs
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = str(root / f"z{stage}-{mode}")
    exported = fds.fp32_state_dict_from_zero_checkpoint(folder, tag="saved")
    live = results[0][f"z{stage}-{mode}"]["saved_masters"]
    assert exported.keys() == live.keys()
    for name in live:
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], live[name]), name
    plain = get_fp32_state_dict_from_zero_checkpoint(folder, tag="saved")
    same = all(torch.equal(plain[name].float(), exported[name]) for name in live)
    assert same == (mode == "fp32-masters")  # zero_to_fp32 alone gives the bf16 masters


UNIVERSAL = {"zero2-bf16-masters-2to1": (2, "bf16-masters", 1), "zero3-bf16-masters-2to3": (3, "bf16-masters", 3),
             "zero1-fp32-masters-2to3": (1, "fp32-masters", 3)}


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage, mode, world", UNIVERSAL.values(), ids=UNIVERSAL.keys())
def test_universal_checkpoint_to_another_world_size(zero_runs, stage, mode, world, monkeypatch):
    root, results = zero_runs
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    folder = str(root / f"z{stage}-{mode}")
    fds.to_universal(folder, tag="saved")
    assert open(os.path.join(folder, "latest_universal")).read().strip() == "saved_universal"
    loaded = run_ranks(_rank_universal, world, folder, stage, mode, timeout=300)[0]
    run = results[0][f"z{stage}-{mode}"]
    for name, saved in run["saved_masters"].items():  # the 24-bit (or fp32) masters, exactly
        assert torch.equal(loaded["masters"][name], saved), name
        assert torch.equal(loaded["own_masters"][name], saved), name  # engine.load_checkpoint, wrapped by initialize
    plain_exact = all(torch.equal(loaded["plain_masters"][n], s) for n, s in run["saved_masters"].items())
    assert plain_exact == (mode == "fp32-masters")  # DeepSpeed's loader alone rounds bf16-mode masters
    # the moments were re-quantized in other groups of 32: the same curve (measured: within 2e-4), not bit for bit
    torch.testing.assert_close(torch.tensor(loaded["after"]), torch.tensor(run["after"]), rtol=1e-3, atol=0)


def test_former_export_name_is_the_same_function():
    assert fds.export_fp32_state_dict is fds.fp32_state_dict_from_zero_checkpoint


def test_merge_of_split_is_identity_for_exported_weights():
    """fp32 export then DeepSpeed's universal load then flashdist's split gives back param and rho."""
    theta = torch.randn(1000) * 3
    low, rho = R.split(theta, torch.bfloat16, torch.int8)
    again_low, again_rho = R.split(R.merge(low, rho), torch.bfloat16, torch.int8)
    assert torch.equal(low, again_low) and torch.equal(rho, again_rho)


# ----- ZeRO-Offload: the optimizer's partitions and state in host memory, the step on the CPU -------------

OFFLOAD_STAGES = (1, 2, 3)


def _offload(config: dict) -> dict:
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["zero_force_ds_cpu_optimizer"] = False  # as the acceptance config writes it; flashdist sets it too
    return config


def _record_steps(engine) -> dict:
    """Wrap the flashdist optimizer's step: for every master partition it steps, the partition before the step
    and the gradient DeepSpeed handed over, keyed by the partition's position in ``master_partitions``."""
    opt = engine.basic_optimizer
    ids = {id(t): i for i, t in enumerate(fds.master_partitions(engine))}
    record = {i: [] for i in ids.values()}
    step = opt.step

    def recording_step(*args, **kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                record[ids[id(p)]].append((p.detach().clone(), p.grad.detach().clone()))
        return step(*args, **kwargs)

    opt.step = recording_step
    return record


def _rank_offload_runs(rank: int, world: int, root: str) -> dict:
    _setup_rank(rank, world)
    out = {}
    for stage in OFFLOAD_STAGES:
        plain = _engine(_config_for(stage, "fp32-masters", world))
        plain_record = _record_steps(plain)
        out[f"z{stage}-plain"] = {"losses": _train(plain, 0, SAVE_AT + AFTER), "state": _local_state(plain),
                                  "grads": {i: [g for _, g in steps] for i, steps in plain_record.items()}}
        engine = _engine(_offload(_config_for(stage, "fp32-masters", world)))
        record = _record_steps(engine)
        run = {"before": _train(engine, 0, SAVE_AT)}
        engine.save_checkpoint(os.path.join(root, f"z{stage}"), tag="saved")
        run["saved_masters"] = fds.fp32_master_weights(engine)
        run["after"] = _train(engine, SAVE_AT, AFTER)
        run["state"] = _local_state(engine)
        run["record"] = record
        run["optimizer_type"] = type(engine.optimizer).__name__
        resumed = _engine(_offload(_config_for(stage, "fp32-masters", world)))
        fds.load_checkpoint(resumed, os.path.join(root, f"z{stage}"), tag="saved")
        run["resumed_after"] = _train(resumed, SAVE_AT, AFTER)
        run["resumed_state"] = _local_state(resumed)
        out[f"z{stage}-offload"] = run
    return out


def _rank_offload_universal(rank: int, world: int, folder: str) -> dict:
    _setup_rank(rank, world)
    config = _offload(_config_for(2, "fp32-masters", world, universal=True))
    engine = _engine(config)
    fds.load_checkpoint(engine, folder)
    return {"masters": fds.fp32_master_weights(engine), "after": _train(engine, SAVE_AT, AFTER),
            "state": _local_state(engine)}


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    root = tmp_path_factory.mktemp("deepspeed-offload")
    return root, run_ranks(_rank_offload_runs, 2, str(root), timeout=600)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", OFFLOAD_STAGES, ids=lambda s: f"zero{s}")
def test_offload_steps_flat_8bit_state_on_the_cpu_exactly(offload_runs, stage):
    """ZeRO-Offload with "type": "FlashAdamW": DeepSpeed keeps the fp32 master partitions on the CPU and calls
    FlashAdamW's step there; the 8-bit flat-layout state lives beside them, and the step is bit for bit a
    standalone FlashAdamW(flat_layout=True) given the same partitions and gradients."""
    _, results = offload_runs
    for rank_result in results:
        run = rank_result[f"z{stage}-offload"]
        assert run["optimizer_type"].startswith("DeepSpeedZeroOptimizer")
        assert len(run["state"]) == len(run["record"]) > 0
        for i, state in enumerate(run["state"]):
            steps = run["record"][i]
            assert len(steps) == SAVE_AT + AFTER and int(state["step"]) == SAVE_AT + AFTER
            master = state["master"]
            assert master.device.type == "cpu" and master.dtype == torch.float32 and master.dim() == 1
            assert state["exp_avg_codes"].dtype == torch.int8 and state["exp_avg_codes"].shape == master.shape
            assert state["exp_avg_scales"].shape == (1, -(-master.numel() // 32))
            assert "rho" not in state  # fp32 masters: nothing to correct
            replay = steps[0][0].clone()
            opt = FlashAdamW([replay], lr=1e-3, weight_decay=0.1, flat_layout=True)
            for before, grad in steps:
                assert torch.equal(replay, before)  # DeepSpeed changed nothing between steps
                replay.grad = grad
                opt.step()
            assert torch.equal(replay, master)
            for key, value in opt.state[replay].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[key])), key


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", OFFLOAD_STAGES, ids=lambda s: f"zero{s}")
def test_offload_tracks_the_run_without_offload(offload_runs, stage):
    """Not bit for bit: DeepSpeed's offload path hands the optimizer gradients that differ from its GPU path by
    fp32 rounding (the same with torch.optim.AdamW), and 8-bit moments can round those apart. From the same
    weights (the first step) both paths' gradients agree to fp32 rounding, and the losses stay on one curve."""
    _, results = offload_runs
    for rank_result in results:
        plain, run = rank_result[f"z{stage}-plain"], rank_result[f"z{stage}-offload"]
        for i, steps in run["record"].items():
            torch.testing.assert_close(steps[0][1], plain["grads"][i][0], rtol=1e-6, atol=1e-9)
    plain, run = results[0][f"z{stage}-plain"], results[0][f"z{stage}-offload"]
    losses = run["before"] + run["after"]
    assert losses[-1] < losses[0] - 0.1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain["losses"]), rtol=1e-4, atol=0)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("stage", OFFLOAD_STAGES, ids=lambda s: f"zero{s}")
def test_offload_save_load_is_exact(offload_runs, stage):
    _, results = offload_runs
    for rank_result in results:
        run = rank_result[f"z{stage}-offload"]
        assert run["resumed_after"] == run["after"]
        for state, resumed in zip(run["state"], run["resumed_state"]):
            assert state.keys() == resumed.keys()
            for key in state:
                assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(resumed[key])), key


@needs_deepspeed
@pytest.mark.slow
def test_offload_universal_checkpoint_to_one_rank(offload_runs, monkeypatch):
    """ZeRO-2 + offload on 2 ranks -> universal checkpoint -> ZeRO-2 + offload on 1 rank: the fp32 masters
    exactly, the moments re-quantized in the new partition's groups (the same curve)."""
    root, results = offload_runs
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    folder = str(root / "z2")
    fds.to_universal(folder, tag="saved")
    loaded = run_ranks(_rank_offload_universal, 1, folder, timeout=300)[0]
    run = results[0]["z2-offload"]
    for name, saved in run["saved_masters"].items():
        assert torch.equal(loaded["masters"][name], saved), name
    assert loaded["state"][0]["exp_avg_codes"].dtype == torch.int8
    torch.testing.assert_close(torch.tensor(loaded["after"]), torch.tensor(run["after"]), rtol=1e-3, atol=0)
