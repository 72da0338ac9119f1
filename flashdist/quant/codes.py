"""Group-wise 8-bit codes for optimizer moments (eager torch; the numerical definition).

Layout. A parameter of two or more dims is viewed as ``(rows, cols)`` with ``rows = shape[0]`` and
``cols = numel // rows``. A quantization group is up to ``GROUP = 32`` consecutive values of ONE row;
groups never cross a row, so a dim-0 shard (FSDP2's ``Shard(0)``) never splits a group. Codes have the
parameter's shape; scales have shape ``(rows, ceil(cols / 32))`` and shard on dim 0 like the parameter.

Codes.
- first moment ``m``: int8. ``x = m / s`` in [-1, 1], softsign companding ``y = 2x / (1 + |x|)``,
  code ``round(127 y)``; inverse ``y = code / 127``, ``x = y / (2 - |y|)``.
- second moment ``v``: uint8 of ``u = sqrt(v)``: ``code = round(255 u / s)``, ``v = (code / 255 * s)^2``.
- ``companded=False`` (the paper's ablation): ``m`` linear int8, ``v`` linear uint8 without the sqrt.

Scales are bfloat16 group absmax values: 2 bytes per 32 values, like fp16, but with fp32's exponent
range. fp16 scales flush the moments of gradients below ~1e-8 to zero (the second moment of a 1e-10
gradient is 1e-20, far under fp16's 6e-8 smallest subnormal) and overflow for gradients above ~256
(v = 65536+). A bf16 scale keeps both ends. Codes are computed against the EXACT fp32 absmax, so a
group's largest value always gets the end code (127 / 255); the stored scale is that absmax rounded to
bf16, so dequantized values carry at most 2^-8 relative scale error on top of the code step. This makes
quantization idempotent: quantize(dequantize(codes, scale)) gives back the same codes and scale, which is
what lets the portable (fp32) checkpoint format round-trip exactly. Rounding is half away from zero,
written out so the Triton kernel can match it bit for bit.
"""

from __future__ import annotations

import torch

from ..kernels.scalars import f32

GROUP = 32
INV127 = f32(1.0 / 127.0)  # fp32 constants: the kernel multiplies by exactly these values
INV255 = f32(1.0 / 255.0)


def quantized_layout(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(rows, cols, groups_per_row)`` for a parameter of this GLOBAL shape, or None when its moments stay
    fp32 (0-d and 1-d parameters: biases and norm weights, a tiny share of any model)."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    return rows, cols, (cols + GROUP - 1) // GROUP


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x.abs() + 0.5).copysign(x)


def to_bf16_value(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest bf16 (ties to even) and return it as fp32."""
    return x.to(torch.bfloat16).float()


def grouped(x: torch.Tensor, cols: int) -> torch.Tensor:
    """View a tensor of ``rows * cols`` values as ``(rows, groups, 32)``, zero-padding each row's tail."""
    x = x.reshape(x.numel() // cols if cols else 0, cols)
    pad = (-cols) % GROUP
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[0], x.shape[1] // GROUP, GROUP)


def ungrouped(x: torch.Tensor, cols: int, shape) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2])[:, :cols].reshape(shape)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_exp_avg(m: torch.Tensor, cols: int, companded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 first moment -> (int8 codes of m's shape, bf16 scales (rows, groups))."""
    mg = grouped(m.float(), cols)
    absmax = mg.abs().amax(dim=-1, keepdim=True) if mg.numel() else mg.new_zeros(mg.shape[:-1] + (1,))
    scale = to_bf16_value(absmax)
    y = (mg / _safe(absmax)).clamp(-1.0, 1.0)
    if companded:
        y = (2.0 * y) / (1.0 + y.abs())
    codes = round_half_away(y * 127.0).to(torch.int8)
    return ungrouped(codes, cols, m.shape), scale.squeeze(-1).to(torch.bfloat16)


def dequantize_exp_avg(codes: torch.Tensor, scales: torch.Tensor, cols: int, companded: bool) -> torch.Tensor:
    y = grouped(codes.float(), cols) * INV127
    if companded:
        y = y / (2.0 - y.abs())
    return ungrouped(y * scales.float().unsqueeze(-1), cols, codes.shape)


def quantize_exp_avg_sq(v: torch.Tensor, cols: int, companded: bool, *, is_sqrt: bool = False):
    """fp32 second moment -> (uint8 codes, bf16 scales). With ``is_sqrt`` the input is already sqrt(v)."""
    u = v.float() if (is_sqrt or not companded) else v.float().sqrt()
    ug = grouped(u, cols)
    absmax = ug.amax(dim=-1, keepdim=True) if ug.numel() else ug.new_zeros(ug.shape[:-1] + (1,))
    scale = to_bf16_value(absmax)
    y = (ug / _safe(absmax)).clamp(0.0, 1.0)
    codes = round_half_away(y * 255.0).to(torch.uint8)
    return ungrouped(codes, cols, v.shape), scale.squeeze(-1).to(torch.bfloat16)


def dequantize_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor, cols: int, companded: bool) -> torch.Tensor:
    u = (grouped(codes.float(), cols) * INV255) * scales.float().unsqueeze(-1)
    if companded:
        u = u * u
    return ungrouped(u, cols, codes.shape)
