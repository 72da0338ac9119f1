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
    muon, adamw = kwargs["params"]
    assert muon["use_muon"] and not adamw["use_muon"]
    names = {n for n, _ in adamw["params"]}
    assert "model.embed_tokens.weight" in names and all(p.ndim == 2 for _, p in muon["params"])
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
