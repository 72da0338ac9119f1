"""Lightning 2.6: FlashAdamW returned from ``configure_optimizers`` under ``precision="bf16-true"`` (bf16
parameters, so rho gives 24-bit master weights), trained by ``Trainer.fit`` on CPU, checkpointed by
``ModelCheckpoint`` and resumed with ``fit(ckpt_path=...)``: the resumed run must equal the run that never
stopped, bit for bit (weights, quantized moments, rho, learning-rate schedule)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="the Lightning recipe is tested against Lightning itself")
import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import flashdist  # noqa: E402
from flashdist import FlashAdamW  # noqa: E402

BATCHES_PER_EPOCH = 2


class TinyRegressor(L.LightningModule):
    """The recipe: build FlashAdamW in configure_optimizers; Lightning casts the module to bf16 first."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        self.param_dtypes_seen = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        self.param_dtypes_seen = {p.dtype for p in self.parameters()}
        optimizer = FlashAdamW(self.named_parameters(), lr=1e-2, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * BATCHES_PER_EPOCH, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4].sin()), batch_size=8, shuffle=False)


def _fit(tmp_path, epochs: int, seed: int, ckpt_path=None, callbacks=()):
    torch.manual_seed(seed)
    model = TinyRegressor()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, precision="bf16-true",
                        callbacks=list(callbacks), logger=False, enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer


def _snapshot(model, optimizer):
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            out[f"{name}:{key}"] = value.clone()
    out["lr"] = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)
    return out


# the resumed run saves nothing, so it has no ModelCheckpoint for Lightning to ask back
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`, callbacks used to create the checkpoint")
def test_bf16_true_fit_checkpoint_resume_is_exact(tmp_path):
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1,
                                  save_on_train_epoch_end=True)
    model, trainer = _fit(tmp_path, epochs=2, seed=0, callbacks=[every_epoch])
    optimizer = trainer.optimizers[0]
    assert model.param_dtypes_seen == {torch.bfloat16}  # the optimizer was built on bf16 parameters
    assert trainer.global_step == 2 * BATCHES_PER_EPOCH
    state = optimizer.state[model.net[0].weight]
    assert state["rho"].dtype == torch.int8 and state["exp_avg_codes"].dtype == torch.int8
    report = flashdist.memory_report(optimizer)
    assert report["fp32_moments"] < report["codes"]  # only the 1-d biases keep fp32 moments
    uninterrupted = _snapshot(model, optimizer)

    first_epoch = sorted((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    assert len(first_epoch) == 1
    resumed_model, resumed = _fit(tmp_path / "resumed", epochs=2, seed=1, ckpt_path=first_epoch[0])
    assert resumed.global_step == 2 * BATCHES_PER_EPOCH
    after = _snapshot(resumed_model, resumed.optimizers[0])
    assert after.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(after[key], value), f"{key} differs after resuming from {first_epoch[0].name}"
