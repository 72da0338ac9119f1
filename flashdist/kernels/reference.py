"""Eager torch implementation of the fused steps (FlashAdam(W), FlashSGD(W), FlashLion, and FlashMuon's
elementwise phases and Newton-Schulz): the CPU path and the test oracle.

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
from .scalars import AdamScalars, LionScalars, MuonScalars, SGDScalars


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

    A group (32 values of one row; one value for fp32 moments) is left exactly as it was (parameter, rho,
    codes, scale) and counted in ``skipped`` where its gradient holds a NaN or an Inf, and where a finite
    gradient's step overflows: with 8-bit moments where a new moment's group absmax does not fit a bf16
    scale that the next step can read (``codes.scale_fits``; |g| above about 1.8e19, whose square is
    infinite, always does), with fp32 moments where the new second moment is not finite (``_store_``).
    torch.optim.AdamW stores an infinite ``v`` there and moves that value by 0 from then on; here the group
    skips this one step and trains normally afterwards.
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
    IEEE's (``triton.bits.div_normalized``), with no range check or branch around each."""
    mg = Q.grouped(m, cols)
    s = Q.pow2_normalizer(Q.nonzero_or_one(Q.group_absmax(mg)))
    scaled = mg * s
    scaled = torch.where(scaled.abs() < UPDATE_FLUSH, torch.zeros_like(scaled), scaled)
    return Q.ungrouped((scaled / Q.grouped(denom, cols)) * (step_size * (1.0 / s)), cols, m.shape)


def _store_(param, grad, rho, theta, moments, *, cols, companded, skipped, check_param=False) -> None:
    """Write the new parameter, rho and moments, except in the groups that are skipped.

    ``moments``: ``(state, scales, new value, is_sqrt)`` of each moment: ``state`` is the int8 (first) or
    uint8 (second: its name ends in _sq, ``is_sqrt`` when the value is already the square root) codes with
    their bf16 ``scales``, or an fp32 tensor when ``scales`` is None (then every element is its own group).

    Which groups are skipped (left exactly as they were and counted in ``skipped``):
    - 8-bit moments: a group where the new value of some moment does not fit its scale
      (``codes.scale_fits`` of its group absmax: NaN, or a bf16 scale that would overflow; for Adam's
      companded second moment the absmax of sqrt(v), whose scale is squared when read). A NaN or Inf
      gradient makes the new first moment non-finite, and so does a finite gradient whose step overflows
      fp32 (|g| above about 1.8e19 squares to inf in Adam's second moment);
    - fp32 moments: an element whose new LAST moment (Adam's v, SGD's or Lion's momentum) is not finite,
      which includes every non-finite gradient; without moments (SGD without momentum), an element whose
      gradient is not finite;
    - with ``check_param`` (SGD, whose update ``lr * d`` has no bound): also a group (element) where the
      new parameter, rounded or split to its dtype, is not finite.
    So the stored state is always finite and dequantizes to finite values at the next step."""
    if rho is not None:
        low, new_rho = R.split(theta, param.dtype, rho.dtype)
    else:
        low = theta.to(param.dtype)
    quantized = bool(moments) and moments[0][1] is not None
    if quantized:
        bad_groups = torch.zeros(Q.grouped(param, cols).shape[:2], dtype=torch.bool, device=param.device)
        for _, _, value, is_sqrt in moments:
            bad_groups |= ~Q.scale_fits(Q.group_absmax(Q.grouped(value, cols)).squeeze(-1), is_sqrt)
        if check_param:
            bad_groups |= ~torch.isfinite(Q.grouped(low.float(), cols)).all(dim=-1)
        bad = _group_mask_to_elements(bad_groups, cols, param.shape)
        n_bad = bad_groups.sum()
    else:
        bad = ~torch.isfinite(moments[-1][2] if moments else grad)
        if check_param:
            bad |= ~torch.isfinite(low)
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
        rho.copy_(torch.where(bad, rho, new_rho))
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
    ``momentum_buffer`` None: no momentum; ``momentum_scales`` None: an fp32 buffer. Groups are skipped and
    counted as in ``adam_step_``, and also where the new parameter would not be finite (``_store_``): SGD's
    step has no bound, and a huge gradient (or Nesterov's ``g + momentum * buf`` of two) can overflow it."""
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
    _store_(param, grad, rho, theta, moments, cols=cols, companded=companded, skipped=skipped, check_param=True)


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


# ----- Muon ------------------------------------------------------------------------------------------------


def fma_rn(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 values rounded once to fp32 (a fused multiply-add), as torch's CPU kernels
    compute ``lerp`` and ``add(alpha=)`` (``vec::fmadd``) and as a GPU's FMA does. In float64: ``a * b`` is
    exact (24 + 24 bits), the sum is rounded to odd (its TwoSum error moves an even result one float64 ulp
    toward the exact sum), and rounding that to fp32 is then the correct rounding of the exact sum."""
    ab = a.double() * b
    c64 = c.double()
    s = ab + c64
    bb = s - ab
    err = (ab - (s - bb)) + (c64 - bb)  # TwoSum: s + err is exactly ab + c
    even = (s.view(torch.int64) & 1) == 0
    odd = torch.where((err != 0) & even, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf)), s)
    return torch.where(torch.isfinite(s), odd, s).float()


def lerp_(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``torch.lerp(start, end, weight)`` of fp32 tensors, as torch computes it: ``start + w (end - start)``
    for ``w < 0.5``, else ``end + (w - 1)(end - start)``, each one fused multiply-add (``fma_rn``), so the
    result does not depend on where a value sits in a tensor (a shard gives the whole tensor's bits)."""
    diff = end - start
    if weight < 0.5:
        return fma_rn(diff, weight, start)
    return fma_rn(diff, weight - 1.0, end)  # (w - 1 is exact in fp32 for w in [0.5, 1])


@torch.no_grad()
def muon_momentum_(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    momentum_scales: torch.Tensor | None,
    *,
    cols: int | None,
    scalars: MuonScalars,
    companded: bool,
) -> torch.Tensor:
    """Muon's phase 1 on one local tensor: ``buf = lerp(buf, g, 1 - momentum)`` stored back (int8 codes with
    bf16 ``momentum_scales``, or an fp32 buffer when ``momentum_scales`` is None) and the update it returns,
    fp32: ``lerp(g, buf, momentum)`` with Nesterov, else ``buf``. A group whose new buffer is not finite (a
    NaN or Inf gradient) keeps its stored buffer; its update is returned as it is (not finite), and phase 3
    then leaves the whole matrix's weight unchanged."""
    sc = scalars
    g = grad.float()
    if momentum_scales is not None:
        buf = Q.dequantize_exp_avg(momentum_buffer, momentum_scales, cols, companded)
    else:
        buf = momentum_buffer
    buf = lerp_(buf, g, sc.buffer_weight)
    update = lerp_(g, buf, sc.momentum) if sc.nesterov else buf
    if momentum_scales is None:
        momentum_buffer.copy_(torch.where(torch.isfinite(buf), buf, momentum_buffer))
        return update
    if buf.numel():
        bad_groups = ~Q.scale_fits(Q.group_absmax(Q.grouped(buf, cols)).squeeze(-1), False)
        codes, scales = Q.quantize_exp_avg(buf, cols, companded)
        bad = _group_mask_to_elements(bad_groups, cols, buf.shape)
        momentum_buffer.copy_(torch.where(bad, momentum_buffer, codes))
        momentum_scales.copy_(torch.where(bad_groups, momentum_scales, scales))
    return update


@torch.no_grad()
def newton_schulz(update: torch.Tensor, *, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """Muon's phase 2 on one WHOLE matrix (2-D): torch.optim.Muon's quintic Newton-Schulz iteration, the
    same operations in the same order (bf16, the transpose of a tall matrix, the Frobenius normalisation
    clamped at ``eps``), so that it gives torch's bits on the same device. Returns bf16. Deterministic on
    one device: a given matrix gives the same bits wherever and whenever it is computed there."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


@torch.no_grad()
def muon_apply_(
    param: torch.Tensor,
    rho: torch.Tensor | None,
    ortho: torch.Tensor,
    *,
    scalars: MuonScalars,
    skipped: torch.Tensor | None,
) -> None:
    """Muon's phase 3 on one local tensor: ``theta = theta * (1 - lr wd)``, then ``theta += -adjusted_lr * O``
    (one fused multiply-add, as torch's ``add_(O, alpha=)``), on the master weight ``param + rho`` split
    back into the parameter and rho. ``ortho``: this tensor's rows of the orthogonalized update (bf16). A
    matrix whose update is not finite (a non-finite gradient: Newton-Schulz spreads it over the whole
    matrix) is left as it was, and its values are counted in ``skipped`` (each its own group here)."""
    if param.numel() == 0:
        return
    sc = scalars
    o = ortho.float()
    bad = ~torch.isfinite(o)
    if bool(bad.any()):
        if skipped is not None:
            skipped.add_(torch.tensor(int(bad.sum()), dtype=skipped.dtype, device=skipped.device))
        o = torch.where(bad, torch.zeros_like(o), o)
    theta = R.merge(param, rho) if rho is not None else param.float()
    theta = fma_rn(o, sc.alpha, theta * sc.decay)
    if rho is not None:
        low, new_rho = R.split(theta, param.dtype, rho.dtype)
        rho.copy_(torch.where(bad, rho, new_rho))
    else:
        low = theta.to(param.dtype)
    param.copy_(torch.where(bad, param, low))
