"""Lightning 2.6 with FlashMuon from ``configure_optimizers`` (its groups from ``muon_param_groups``) under
``precision="bf16-true"``: a fit, a checkpoint and a resume that equals the uninterrupted run bit for bit."""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from test_lightning import BATCHES_PER_EPOCH, TinyRegressor, _data, _snapshot  # noqa: E402

from flashdist import FlashMuon, muon_param_groups  # noqa: E402


class TinyMuonRegressor(TinyRegressor):
    def configure_optimizers(self):
        optimizer = FlashMuon(muon_param_groups(self, adamw_lr=1e-2), lr=0.02)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _fit(tmp_path, epochs: int, seed: int, ckpt_path=None, callbacks=()):
    torch.manual_seed(seed)
    model = TinyMuonRegressor()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, precision="bf16-true",
                        callbacks=list(callbacks), logger=False, enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer


# the resumed run saves nothing, so it has no ModelCheckpoint for Lightning to ask back
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_flash_muon_fit_checkpoint_resume_is_exact(tmp_path):
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1,
                                  save_on_train_epoch_end=True)
    model, trainer = _fit(tmp_path, epochs=2, seed=0, callbacks=[every_epoch])
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, FlashMuon) and trainer.global_step == 2 * BATCHES_PER_EPOCH
    state = optimizer.state[model.net[0].weight]
    assert state["rho"].dtype == torch.int8 and state["momentum_buffer_codes"].dtype == torch.int8
    uninterrupted = _snapshot(model, optimizer)
    (first_epoch,) = sorted((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    resumed_model, resumed = _fit(tmp_path / "resumed", epochs=2, seed=1, ckpt_path=first_epoch)
    after = _snapshot(resumed_model, resumed.optimizers[0])
    assert after.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(after[key], value), f"{key} differs after resuming from {first_epoch.name}"
