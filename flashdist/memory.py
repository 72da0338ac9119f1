"""Bytes per parameter: the analytic budget (the paper's Table 1) and what an optimizer really holds."""

from __future__ import annotations

import torch

from . import distributed as D
from .quant.codes import GROUP
from .quant.moment import QuantizedMoment

SCALE_BYTES = 2.0 / GROUP  # one bf16 scale per group of 32 values

_KINDS = {
    # kind: (master, rho, grad, moments); a moment is fp32 (4) or an 8-bit code plus its group scale
    "adamw": (4, 0, 4, (4, 4)),
    "flash_adamw": (2, 1, 2, (1 + SCALE_BYTES, 1 + SCALE_BYTES)),
    "sgd": (4, 0, 4, (4,)),
    "flash_sgd": (2, 1, 2, (1 + SCALE_BYTES,)),
    "lion": (4, 0, 4, (4,)),
    "flash_lion": (2, 1, 2, (1 + SCALE_BYTES,)),
    "muon": (4, 0, 4, (4,)),  # torch.optim.Muon: fp32 weights, gradients and momentum (matrices)
    "flash_muon": (2, 1, 2, (1 + SCALE_BYTES,)),  # FlashMuon's matrices (its AdamW groups: flash_adamw)
}
_ALIASES = {"adamw_ref": "adamw", "sgd_ref": "sgd", "adam": "adamw", "flash_adam": "flash_adamw", "sgdw": "sgd",
            "flash_sgdw": "flash_sgd"}


def bytes_per_param(kind: str, gradient_release: bool = False) -> dict[str, float]:
    """Analytic bytes per parameter held by training with ``kind`` (adamw, flash_adamw, sgd, flash_sgd, lion,
    flash_lion, muon, flash_muon; adam, flash_adam, sgdw and flash_sgdw are accepted too): master weight, rho ("ecc"), gradient
    (0 with gradient release), each moment ("m", and "v" for Adam), total. SGD counts a momentum buffer; Muon counts its matrices (their transient
    update being orthogonalized not included; FlashMuon's AdamW groups hold flash_adamw's budget)."""
    key = _ALIASES.get(kind, kind)
    if key not in _KINDS:
        raise ValueError(f"flashdist: unknown optimizer kind {kind!r}; expected one of {sorted(_KINDS)}")
    master, rho, grad, moments = _KINDS[key]
    parts = {"master": float(master), "ecc": float(rho), "grad": 0.0 if gradient_release else float(grad)}
    for name, b in zip(("m", "v"), moments):
        parts[name] = b
    parts["total"] = round(sum(parts.values()), 4)
    return parts


def _nbytes(t: torch.Tensor | None) -> int:
    t = D.local(t)
    return 0 if t is None else t.numel() * t.element_size()


@torch.no_grad()
def memory_report(optimizer: torch.optim.Optimizer, *, include_grads: bool = True) -> dict[str, float]:
    """MEASURED bytes held for the optimizer's parameters on this rank, summed from the real local tensors:
    ``params``, ``grads`` (those that exist now), ``rho``, ``codes``, ``scales``, ``fp32_moments``,
    ``other`` (any other tensor state), their ``total`` and ``bytes_per_param`` (total / local numel).
    Frozen parameters count in ``params`` and ``numel`` but hold no state; parameters swapped into
    ``param_groups`` since the last step are counted with their (new) state."""
    sync_state = getattr(optimizer, "sync_state", None)
    if sync_state is not None:  # a flashdist optimizer whose param_groups were swapped: count the live state
        sync_state()
    out = dict.fromkeys(("params", "grads", "rho", "codes", "scales", "fp32_moments", "other"), 0)
    numel = 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            numel += D.local(p).numel()
            out["params"] += _nbytes(p)
            if include_grads and p.grad is not None:
                out["grads"] += _nbytes(p.grad)
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor) or key == "step":
                    continue
                part = QuantizedMoment.split_key(key)[1]  # "codes" or "scales" of a quantized moment
                if key == "rho":
                    out["rho"] += _nbytes(value)
                elif part is not None:
                    out[part] += _nbytes(value)
                elif value.dtype == torch.float32 and key.startswith("exp_avg") or key == "momentum_buffer":
                    out["fp32_moments"] += _nbytes(value)
                else:
                    out["other"] += _nbytes(value)
    out["total"] = sum(out.values())
    out["numel"] = numel
    out["bytes_per_param"] = out["total"] / numel if numel else 0.0
    return out
