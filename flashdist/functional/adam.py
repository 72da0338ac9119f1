"""Functional FlashAdam(W) step on lists of plain local tensors: the layer under the optimizer classes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import cpu, reference
from ..kernels.scalars import AdamScalars
from .backend import cpu_fallback, host_number, on_device, resolve_backend


def flash_adam(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor] | None,
    exp_avg_sq_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int | torch.Tensor,
    decoupled: bool,
    companded: bool = True,
    skipped: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """One Adam (``decoupled=False``, L2 weight decay) or AdamW step, in place, on local tensors.

    All tensors of one call share one layout: quantized moments (int8 ``exp_avgs`` / uint8 ``exp_avg_sqs``
    codes with bf16 ``*_scales`` of shape (rows, ceil(cols/32)), ``cols[i]`` the row length) when
    ``exp_avg_scales`` is given, fp32 moments otherwise; a rho correction for every parameter when ``rhos``
    is given. ``step`` is the 1-based step count of every tensor in the call. ``skipped`` (a one-element
    int32 tensor on the parameters' device) counts the groups left unchanged because their gradient held a
    NaN or an Inf, or their step overflowed (``reference.adam_step_``).

    Capturable: on CUDA, ``step`` given as an fp32 tensor of one element on the parameters' device (and
    ``lr`` a float or such a tensor) makes the step compute its scalars there, from values read when it
    runs, so that a CUDA graph can capture it; the results are the same bits.
    """
    if not params:
        return
    device = params[0].device
    chosen = resolve_backend(backend, device)
    if chosen == "triton" and on_device(step, device):  # capturable: scalars computed on the device
        from ..kernels.triton import device_scalars

        scalars = device_scalars.adam(step, lr if on_device(lr, device) else host_number(lr), beta1=beta1,
                                      beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
    else:
        scalars = AdamScalars.make(lr=host_number(lr), beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                   step=int(host_number(step)), decoupled=decoupled)
    if chosen == "triton":
        from ..kernels.triton.fused import adam_step_multi

        adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, rhos,
                        cols=cols, scalars=scalars, companded=companded, skipped=skipped)
        return
    if chosen == "cpu":
        done = cpu.adam_step(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, rhos,
                            cols=cols, scalars=scalars, companded=companded, skipped=skipped)
        if not cpu_fallback(backend, done):
            return
    for i, p in enumerate(params):
        reference.adam_step_(
            p, grads[i], exp_avgs[i], exp_avg_sqs[i],
            exp_avg_scales[i] if exp_avg_scales is not None else None,
            exp_avg_sq_scales[i] if exp_avg_sq_scales is not None else None,
            rhos[i] if rhos is not None else None,
            cols=cols[i] if cols is not None else None, scalars=scalars, companded=companded, skipped=skipped,
        )
