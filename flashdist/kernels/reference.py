"""Eager torch implementation of the fused FlashAdam(W) step: the CPU path and the test oracle.

It defines the arithmetic, operation by operation, that the Triton kernel reproduces (bitwise under
``TRITON_INTERPRET=1``, and on CUDA with ``FLASHDIST_EXACT=1``, the default): every scalar is fp32
(``AdamScalars``), every intermediate is fp32, every operation is IEEE round-to-nearest (the square root
too: ``codes.sqrt_rn``), and the order of operations below is the order in the kernel. Per value it
divides twice (the update ``m / denom`` and the companding of the new first moment) and takes one square
root; the rest is multiplications (``codes``, ``rho`` and ``AdamScalars`` say how).
"""

from __future__ import annotations

import torch

from ..quant import codes as Q
from ..quant import rho as R
from .scalars import AdamScalars


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
    theta = theta - (m / denom) * sc.step_size

    bad = ~torch.isfinite(grad)
    if quantized:
        bad_groups = Q.grouped(bad, cols).any(dim=-1)
        bad = _group_mask_to_elements(bad_groups, cols, param.shape)
        m_codes, m_scales = Q.quantize_exp_avg(m, cols, companded)
        v_codes, v_scales = Q.quantize_exp_avg_sq(u if companded else v, cols, companded, is_sqrt=companded)
        exp_avg.copy_(torch.where(bad, exp_avg, m_codes))
        exp_avg_sq.copy_(torch.where(bad, exp_avg_sq, v_codes))
        exp_avg_scales.copy_(torch.where(bad_groups, exp_avg_scales, m_scales))
        exp_avg_sq_scales.copy_(torch.where(bad_groups, exp_avg_sq_scales, v_scales))
        n_bad = bad_groups.sum()
    else:
        exp_avg.copy_(torch.where(bad, exp_avg, m))
        exp_avg_sq.copy_(torch.where(bad, exp_avg_sq, v))
        n_bad = bad.sum()

    if rho is not None:
        low, new_rho = R.split(theta, param.dtype, rho.dtype)
        rho.copy_(torch.where(bad, rho, new_rho))
    else:
        low = theta.to(param.dtype)
    param.copy_(torch.where(bad, param, low))
    if skipped is not None:
        skipped.add_(n_bad.to(skipped.device, skipped.dtype))
