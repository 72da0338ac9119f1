"""Functional FlashLion step on lists of plain local tensors: the layer under the optimizer class."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import cpu, reference
from ..kernels.scalars import LionScalars
from .backend import cpu_fallback, host_number, on_device, resolve_backend


def flash_lion(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    companded: bool = True,
    skipped: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """One Lion step (decoupled weight decay), in place, on local tensors. ``exp_avgs``: int8 codes with bf16
    ``exp_avg_scales`` of shape (rows, ceil(cols/32)), or fp32 momenta when ``exp_avg_scales`` is None.
    ``rhos``, ``skipped`` and ``backend`` as in ``flash_adam``; ``lr`` held on the device (Lion's scalars do
    not depend on the step count) makes it capturable, as there."""
    if not params:
        return
    device = params[0].device
    chosen = resolve_backend(backend, device)
    if chosen == "triton" and on_device(lr, device):  # capturable: scalars computed on the device
        from ..kernels.triton import device_scalars

        scalars = device_scalars.lion(lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    else:
        scalars = LionScalars.make(lr=host_number(lr), beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    if chosen == "triton":
        from ..kernels.triton.fused import lion_step_multi

        lion_step_multi(params, grads, exp_avgs, exp_avg_scales, rhos, cols=cols, scalars=scalars,
                        companded=companded, skipped=skipped)
        return
    if chosen == "cpu":
        done = cpu.lion_step(params, grads, exp_avgs, exp_avg_scales, rhos, cols=cols, scalars=scalars,
                            companded=companded, skipped=skipped)
        if not cpu_fallback(backend, done):
            return
    for i, p in enumerate(params):
        reference.lion_step_(
            p, grads[i], exp_avgs[i], exp_avg_scales[i] if exp_avg_scales is not None else None,
            rhos[i] if rhos is not None else None, cols=cols[i] if cols is not None else None, scalars=scalars,
            companded=companded, skipped=skipped,
        )
