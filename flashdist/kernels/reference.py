"""Eager torch implementation of the fused steps (FlashAdam(W), FlashSGD(W), FlashLion): the CPU path and
the test oracle.

It defines the arithmetic, operation by operation, that the Triton kernel reproduces (bitwise under
``TRITON_INTERPRET=1``, and on CUDA with ``FLASHDIST_EXACT=1``, the default): every scalar is fp32
(``AdamScalars``, ``SGDScalars``, ``LionScalars``), every intermediate is fp32, every operation is IEEE
round-to-nearest (the square root too: ``codes.sqrt_rn``), and the order of operations below is the order
in the kernel. Per value Adam divides twice (the update ``m / denom`` and the companding of the new first
moment) and takes one square root; SGD and Lion divide once (the companding); the rest is multiplications
(``codes``, ``rho`` and the scalars say how)."""

from __future__ import annotations

import torch

from ..quant import codes as Q
from ..quant import rho as R
from .scalars import AdamScalars, LionScalars, SGDScalars


def _group_mask_to_elements(bad_groups: torch.Tensor, cols: int, shape) -> torch.Tensor:
    return Q.ungrouped(bad_groups.unsqueeze(-1).expand(*bad_groups.shape, Q.GROUP), cols, shape)


@torch.no_grad()
def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scales: torch.Tensor | None,
    exp_avg_sq_scales: torch.Tensor | None,
    rho: torch.Tensor | None,
    *,
    cols: int | None,
    scalars: AdamScalars,
    companded: bool,
    skipped: torch.Tensor | None,
) -> None:
    """One step on one local tensor, in place. ``exp_avg_scales is None`` means fp32 moments.

    A group (32 values of one row; one value for fp32 moments) whose gradient holds a NaN or an Inf is
    left exactly as it was (parameter, rho, codes, scale) and counted in ``skipped``.
    """
    if param.numel() == 0:
        return
    sc = scalars
    quantized = exp_avg_scales is not None
    g = grad.float()
    if quantized:  # beta1 * m and beta2 * v, dequantized with the betas in the per-group multiplier
        m_decayed = Q.dequantize_exp_avg(exp_avg, exp_avg_scales, cols, companded, sc.beta1)
        v_decayed = Q.dequantize_exp_avg_sq(exp_avg_sq, exp_avg_sq_scales, cols, companded, sc.beta2)
    else:
        m_decayed, v_decayed = exp_avg * sc.beta1, exp_avg_sq * sc.beta2
    theta = R.merge(param, rho) if rho is not None else param.float()

    if sc.decoupled:
        theta = theta * sc.decay
    else:
        g = g + theta * sc.weight_decay
    m = m_decayed + g * sc.one_minus_beta1
    v = v_decayed + (g * g) * sc.one_minus_beta2
    u = Q.sqrt_rn(v)
    denom = u * sc.inv_bias_correction2_sqrt + sc.eps
    if quantized:
        theta = theta - _adam_update(m, denom, cols, sc.step_size)
    else:
        theta = theta - (m / denom) * sc.step_size

    sqrt_codes = quantized and companded  # the second moment is stored as codes of its square root
    moments = [(exp_avg, exp_avg_scales, m, False), (exp_avg_sq, exp_avg_sq_scales, u if sqrt_codes else v,
                                                      sqrt_codes)]
    _store_(param, grad, rho, theta, moments, cols=cols, companded=companded, skipped=skipped)


UPDATE_FLUSH = 2.0**-48  # scaled first moments below this do not move the parameter (_adam_update)


def _adam_update(m: torch.Tensor, denom: torch.Tensor, cols: int, step_size: float) -> torch.Tensor:
    """``(m / denom) * step_size`` of 8-bit moments, computed per group of 32 with ``m`` scaled by ``s``, the
    power of two that brings the group's absmax into [1, 2) (``codes.pow2_normalizer``):
    ``((m s) / denom) * (step_size / s)``, where scaled values below ``UPDATE_FLUSH`` (2^-48) are taken as 0.

    Scaling by powers of two is exact, so this is the plain quotient times the step size wherever nothing
    under- or overflows, except that first moments more than about 2^48 times below their group's largest
    do not move the parameter (the next step stores them as code 0 anyway: the codes resolve about 1/254 of
    the absmax). What it buys: the kernel's divisions then stay in the range where CUDA's fast path is
    IEEE's (``fused._div_normalized``), with no range check or branch around each."""
    mg = Q.grouped(m, cols)
    s = Q.pow2_normalizer(Q.nonzero_or_one(Q.group_absmax(mg)))
    scaled = mg * s
    scaled = torch.where(scaled.abs() < UPDATE_FLUSH, torch.zeros_like(scaled), scaled)
    return Q.ungrouped((scaled / Q.grouped(denom, cols)) * (step_size * (1.0 / s)), cols, m.shape)


def _store_(param, grad, rho, theta, moments, *, cols, companded, skipped) -> None:
    """Write the new parameter, rho and moments, except where a group's gradient holds a NaN or an Inf (with
    8-bit moments: where the group's new first moment is not finite, which is the same groups).

    ``moments``: ``(state, scales, new value, is_sqrt)`` of each moment: ``state`` is the int8 (first) or
    uint8 (second: its name ends in _sq, ``is_sqrt`` when the value is already the square root) codes with
    their bf16 ``scales``, or an fp32 tensor when ``scales`` is None (then every element is its own group)."""
    quantized = bool(moments) and moments[0][1] is not None
    if quantized:
        # The new first moment of a group is finite exactly where its gradient is (the update only scales and
        # adds finite numbers to it, within fp32's range; with coupled weight decay a non-finite parameter
        # also makes it so), and the kernel reads the flag from the group absmax it computes anyway.
        bad_groups = ~torch.isfinite(Q.grouped(moments[0][2], cols)).all(dim=-1)
        bad = _group_mask_to_elements(bad_groups, cols, param.shape)
        n_bad = bad_groups.sum()
    else:
        bad = ~torch.isfinite(grad)
        n_bad = bad.sum()
    for k, (state, scales, value, is_sqrt) in enumerate(moments):
        if scales is None:
            state.copy_(torch.where(bad, state, value))
            continue
        if state.dtype == torch.uint8:
            codes, new_scales = Q.quantize_exp_avg_sq(value, cols, companded, is_sqrt=is_sqrt)
        else:
            codes, new_scales = Q.quantize_exp_avg(value, cols, companded)
        state.copy_(torch.where(bad, state, codes))
        scales.copy_(torch.where(bad_groups, scales, new_scales))

    if rho is not None:
        low, new_rho = R.split(theta, param.dtype, rho.dtype)
        rho.copy_(torch.where(bad, rho, new_rho))
    else:
        low = theta.to(param.dtype)
    param.copy_(torch.where(bad, param, low))
    if skipped is not None:
        skipped.add_(n_bad.to(skipped.device, skipped.dtype))


def _decayed_first_moment(state, scales, cols, companded, factor):
    """``factor`` times the stored first moment (int8 codes with scales, or fp32)."""
    if scales is not None:
        return Q.dequantize_exp_avg(state, scales, cols, companded, factor)
    return state * factor


@torch.no_grad()
def sgd_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    momentum_scales: torch.Tensor | None,
    rho: torch.Tensor | None,
    *,
    cols: int | None,
    scalars: SGDScalars,
    companded: bool,
    skipped: torch.Tensor | None,
) -> None:
    """One SGD step on one local tensor, in place (``torch.optim.SGD``'s update on the fp32 master weight).
    ``momentum_buffer`` None: no momentum; ``momentum_scales`` None: an fp32 buffer. Non-finite gradient
    groups are skipped and counted as in ``adam_step_``."""
    if param.numel() == 0:
        return
    sc = scalars
    g = grad.float()
    theta = R.merge(param, rho) if rho is not None else param.float()
    if sc.decoupled:
        theta = theta * sc.decay
    else:
        g = g + theta * sc.weight_decay
    moments = []
    if momentum_buffer is not None:
        m = _decayed_first_moment(momentum_buffer, momentum_scales, cols, companded, sc.momentum_decay)
        m = m + g * sc.momentum_gain
        d = g + m * sc.momentum if sc.nesterov else m
        moments.append((momentum_buffer, momentum_scales, m, False))
    else:
        d = g
    theta = theta - d * sc.lr
    _store_(param, grad, rho, theta, moments, cols=cols, companded=companded, skipped=skipped)


@torch.no_grad()
def lion_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_scales: torch.Tensor | None,
    rho: torch.Tensor | None,
    *,
    cols: int | None,
    scalars: LionScalars,
    companded: bool,
    skipped: torch.Tensor | None,
) -> None:
    """One Lion step on one local tensor, in place. ``exp_avg_scales`` None: an fp32 momentum. The sign is
    taken as ``(c > 0) - (c < 0)`` (0 for a NaN, where torch.sign gives NaN: only reachable through a
    non-finite gradient, whose group is skipped anyway)."""
    if param.numel() == 0:
        return
    sc = scalars
    g = grad.float()
    theta = R.merge(param, rho) if rho is not None else param.float()
    theta = theta * sc.decay
    m = _decayed_first_moment(exp_avg, exp_avg_scales, cols, companded, 1.0)
    c = m * sc.beta1 + g * sc.one_minus_beta1
    direction = (c > 0).float() - (c < 0).float()
    theta = theta - direction * sc.lr
    m = m * sc.beta2 + g * sc.one_minus_beta2
    _store_(param, grad, rho, theta, [(exp_avg, exp_avg_scales, m, False)], cols=cols, companded=companded,
            skipped=skipped)
