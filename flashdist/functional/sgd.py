"""Functional FlashSGD(W) step on lists of plain local tensors: the layer under the optimizer classes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import cpu, reference
from ..kernels.scalars import SGDScalars
from .backend import cpu_fallback, host_number, on_device, resolve_backend


def flash_sgd(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None,
    momentum_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    lr: float | torch.Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    step: int | torch.Tensor,
    decoupled: bool,
    companded: bool = True,
    skipped: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """One SGD step (``decoupled=False``: torch.optim.SGD, L2 weight decay added to the gradient) or SGDW
    step, in place, on local tensors.

    ``momentum_buffers`` is None without momentum; otherwise int8 codes with bf16 ``momentum_scales`` of
    shape (rows, ceil(cols/32)) (``cols[i]`` the row length), or fp32 buffers when ``momentum_scales`` is
    None. At ``step`` 1 the buffer becomes the gradient itself, as in torch.optim.SGD. ``rhos``, ``skipped``
    and ``backend`` as in ``flash_adam``; ``step`` and ``lr`` held on the device make it capturable, as there.
    """
    if not params:
        return
    device = params[0].device
    chosen = resolve_backend(backend, device)
    if chosen == "triton" and on_device(step, device):  # capturable: scalars computed on the device
        from ..kernels.triton import device_scalars

        scalars = device_scalars.sgd(step, lr if on_device(lr, device) else host_number(lr), momentum=momentum,
                                     dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                                     decoupled=decoupled)
    else:
        scalars = SGDScalars.make(lr=host_number(lr), momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                  nesterov=nesterov, step=int(host_number(step)), decoupled=decoupled)
    if chosen == "triton":
        from ..kernels.triton.fused import sgd_step_multi

        sgd_step_multi(params, grads, momentum_buffers, momentum_scales, rhos, cols=cols, scalars=scalars,
                       companded=companded, skipped=skipped)
        return
    if chosen == "cpu":
        done = cpu.sgd_step(params, grads, momentum_buffers, momentum_scales, rhos, cols=cols,
                            scalars=scalars, companded=companded, skipped=skipped)
        if not cpu_fallback(backend, done):
            return
    for i, p in enumerate(params):
        reference.sgd_step_(
            p, grads[i], momentum_buffers[i] if momentum_buffers is not None else None,
            momentum_scales[i] if momentum_scales is not None else None, rhos[i] if rhos is not None else None,
            cols=cols[i] if cols is not None else None, scalars=scalars, companded=companded, skipped=skipped,
        )
