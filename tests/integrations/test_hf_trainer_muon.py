"""optim="flash_muon" through the Trainer (after flashdist.integrations.transformers.register()): the param
groups come from the model (matrices Muon, embeddings, head and norms AdamW) and training lowers the loss. The
checkpoint, the bit-exact resume and the export are cells of tests/conformance/test_matrix.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashdist import FlashMuon  # noqa: E402
from flashdist.integrations import transformers as fd_hf  # noqa: E402
from _tiny_llama import tiny_llama  # noqa: E402 (tests/integrations/_tiny_llama.py)
from test_hf_trainer import _args, _data, _state  # noqa: E402

fd_hf.register()


def test_flash_muon_groups_come_from_the_model(tmp_path):
    args = _args(tmp_path, optim="flash_muon", adam_beta2=0.95)
    model = tiny_llama()
    cls, kwargs = fd_hf.optimizer_cls_and_kwargs("flash_muon", args, model=model)
    assert cls is FlashMuon and kwargs["adamw_betas"] == (0.9, 0.95) and "adamw_eps" in kwargs
    muon, adamw, no_decay = kwargs["params"]
    assert muon["use_muon"] and not adamw["use_muon"] and not no_decay["use_muon"]
    names = {n for n, _ in adamw["params"]}
    assert "model.embed_tokens.weight" in names and all(p.ndim == 2 for _, p in muon["params"])
    # TrainingArguments.weight_decay, as the Trainer's decay / no-decay groups take it: none for norm weights
    assert muon["weight_decay"] == adamw["weight_decay"] == args.weight_decay and no_decay["weight_decay"] == 0
    assert {n for n, _ in no_decay["params"]} == {n for n, p in model.named_parameters() if p.ndim == 1}
    for decay in (0.0, 0.03):
        groups = fd_hf.optimizer_cls_and_kwargs("flash_muon", _args(tmp_path, optim="flash_muon",
                                                                    weight_decay=decay), model=model)[1]["params"]
        assert [g["weight_decay"] for g in groups] == [decay, decay, 0.0]
    groups = fd_hf.optimizer_cls_and_kwargs("flash_muon", args, "weight_decay=0.2", model=model)[1]["params"]
    assert [g["weight_decay"] for g in groups] == [0.2, 0.2, 0.0]  # optim_args win
    groups = fd_hf.optimizer_cls_and_kwargs("flash_muon", model=model)[1]["params"]  # no args: FlashMuon's 0.1
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1, 0.0]
    # a learned scale vector that is neither a bias nor a norm weight decays, as in the Trainer's own groups
    model.model.gate = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    groups = fd_hf.optimizer_cls_and_kwargs("flash_muon", args, model=model)[1]["params"]
    decayed = {n for g in groups if g["weight_decay"] for n, _ in g["params"]}
    assert "model.gate" in decayed and "model.norm.weight" not in decayed
    assert decayed == set(transformers.Trainer.get_decay_parameter_names(None, model))
    del model.model.gate
    # the AdamW groups' own learning rate (muon_param_groups' adamw_lr), checked as the lr it becomes
    cls, kwargs = fd_hf.optimizer_cls_and_kwargs("flash_muon", args, "adamw_lr=3e-4", model=model)
    assert [g.get("lr") for g in kwargs["params"]] == [None, 3e-4, 3e-4] and kwargs["lr"] == args.learning_rate
    assert "adamw_lr" not in kwargs
    with pytest.raises(ValueError, match=r"optim_args='adamw_lr=-1'.*lr must be"):
        fd_hf.optimizer_cls_and_kwargs("flash_muon", args, "adamw_lr=-1", model=model)
    with pytest.raises(ValueError, match=r"\['adamw_lr'\], which FlashAdamW does not take"):
        fd_hf.optimizer_cls_and_kwargs("flash_adamw", _args(tmp_path, optim="flash_adamw"), "adamw_lr=3e-4")
    with pytest.raises(ValueError, match="pass model="):
        fd_hf.optimizer_cls_and_kwargs("flash_muon", args)


def test_trainer_trains_with_flash_muon(tmp_path):
    full = transformers.Trainer(model=tiny_llama(), args=_args(tmp_path / "run", optim="flash_muon"),
                                train_dataset=_data())
    full.train()
    _, state, opt = _state(full)
    assert isinstance(opt, FlashMuon)
    losses = [log["loss"] for log in full.state.log_history if "loss" in log]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses
    w = "model.layers.0.mlp.up_proj.weight"
    assert state[w]["rho"].dtype == torch.int8 and state[w]["momentum_buffer_codes"].dtype == torch.int8
    assert "exp_avg_codes" in state["model.embed_tokens.weight"]


def _losses_against_torch_muon(tmp_path, device: str, optim_args: str, dtype: torch.dtype) -> tuple[list, list]:
    """The Trainer's losses with optim="flash_muon" (a model in ``dtype``) and with torch.optim.Muon on the
    matrices + torch.optim.AdamW on the rest (an fp32 model, launch/benchlib.py's MuonWithAdamW), both with
    FlashMuon's defaults (momentum 0.95, Nesterov, AdamW betas (0.9, 0.95)) and the Trainer's weight decay (0.1,
    none for norm weights), 12 steps."""
    from flashdist import muon_param_groups
    from launch.benchlib import MuonWithAdamW

    over = dict(max_steps=12, save_strategy="no", use_cpu=device == "cpu", learning_rate=5e-3)
    flash = transformers.Trainer(model=tiny_llama(dtype).to(device), train_dataset=_data(),
                                 args=_args(tmp_path / "flash", optim="flash_muon", optim_args=optim_args, **over))
    flash.train()
    model = tiny_llama(torch.float32).to(device)
    muon, adamw = muon_param_groups(model)
    rest = [p for _, p in adamw["params"]]  # the Trainer's decay / no-decay split: none for norm weights
    rest = [{"params": [p for p in rest if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in rest if p.ndim <= 1], "weight_decay": 0.0}]
    ref = MuonWithAdamW([p for _, p in muon["params"]], rest, lr=5e-3, weight_decay=0.1)
    torch_run = transformers.Trainer(model=model, train_dataset=_data(), optimizers=(ref, None),
                                     args=_args(tmp_path / "torch", **over))
    torch_run.train()
    return [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (flash, torch_run)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_trainer_with_flash_muon_follows_torch_muon(tmp_path, device):
    """A real client against torch.optim.Muon: with fp32 state and 32-bit masters on an fp32 model the losses
    are torch's within 5e-4 (Newton-Schulz runs as torch's; the AdamW groups' fused update rounds apart from
    torch's foreach AdamW by an ulp, which the bf16 Newton-Schulz of the next steps can widen: 7e-5 on CPU);
    the defaults on a bf16 model (24-bit masters, 8-bit momentum) within 1% at every step (3e-4 on CPU)."""
    exact, ref = _losses_against_torch_muon(tmp_path / "fp32", device, "quantize_states=False,master_weight_bits=32",
                                            torch.float32)
    assert len(ref) == 12 and ref[-1] < ref[0] - 0.5, ref
    assert exact == pytest.approx(ref, rel=5e-4), (exact, ref)
    default, _ = _losses_against_torch_muon(tmp_path / "bf16", device, "", torch.bfloat16)
    assert default == pytest.approx(ref, rel=1e-2), (default, ref)
