"""One optimizer moment kept as 8-bit group codes with bf16 group scales: the ``QuantizedMoment`` type.

This module is the only one that knows how such a moment is spelled in optimizer state (``<name>_codes``
and ``<name>_scales``), which moments are signed and which are second moments (``exp_avg_sq``: unsigned
codes of ``sqrt(v)`` when companded, of ``v`` itself when linear), and how the layout of a parameter's
moment follows from its GLOBAL shape. The arithmetic is ``flashdist.quant.codes``; kernels receive the
plain local ``codes`` and ``scales`` tensors of these objects, never the objects.

A moment with ``companded=True`` (the default) costs 1 + 2/32 bytes per value: int8 (first moment) or uint8
(second) codes and one bf16 scale per group of up to 32 values of one row. See ``flashdist.quant.codes``
for the numerical caveats (quantization is idempotent, so a portable round trip gives back the same bits).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import distributed as D
from . import codes as Q

CODES = "codes"  # the two parts of a quantized moment, as they end its state keys and name memory_report's rows
SCALES = "scales"
_SUFFIXES = {f"_{CODES}": CODES, f"_{SCALES}": SCALES}


@dataclass(frozen=True)
class MomentLayout:
    """How the values of a parameter's moment are grouped, decided from the parameter's GLOBAL shape."""

    rows: int  #: rows of the grouped view (shape[0] row-aligned, 1 flat)
    cols: int  #: values per row; a group is up to ``GROUP`` consecutive values of one row
    groups_per_row: int  #: ceil(cols / GROUP): the scales' second dim
    flat: bool  #: one row of ``numel`` values in storage order (DeepSpeed's flat 1-D partitions)

    @classmethod
    def of(cls, shape, flat: bool = False) -> MomentLayout | None:
        """The layout for a parameter of GLOBAL ``shape``, or None when its moments stay fp32 (0-d and 1-d
        parameters in the row-aligned layout: ``codes.quantized_layout``)."""
        if flat:
            numel = 1
            for d in shape:
                numel *= d
            return cls(1, numel, (numel + Q.GROUP - 1) // Q.GROUP, True)
        layout = Q.quantized_layout(shape)
        return None if layout is None else cls(*layout, False)

    def local(self, local_shape) -> MomentLayout:
        """The layout of a rank's local shard of ``local_shape``: the one place that maps a shard to the rows,
        row length and groups the step and the (de)quantization of its values see. A dim-0 shard holds whole
        rows; a shard inside the row (tensor parallelism's ``Shard(1)``) holds whole groups of each row, which
        flashdist.distributed.check_placements guarantees, so it is a shorter row of whole groups. A flat
        layout is never sharded by flashdist (DeepSpeed hands each rank its own flat partition)."""
        if self.flat:
            return self
        cols = math.prod(local_shape[1:])
        return MomentLayout(local_shape[0], cols, (cols + Q.GROUP - 1) // Q.GROUP, False)

    def local_scales_shape(self, local_shape) -> tuple[int, int]:
        """Shape of the scales a rank holds beside a local shard of ``local_shape``."""
        local = self.local(local_shape)
        return local.rows, local.groups_per_row


def state_layout(shape, flat_layout: bool = False) -> tuple[int, int, int] | None:
    """``(rows, cols, groups_per_row)`` of the quantized moments of a parameter of this GLOBAL shape, or None
    for fp32 moments. Row-aligned (flashdist.quant.codes.quantized_layout) by default; with ``flat_layout``
    the tensor is ONE row of ``numel`` values, whatever its shape: groups of 32 consecutive values in storage
    order (DeepSpeed's flat 1-D partitions)."""
    layout = MomentLayout.of(shape, flat_layout)
    return None if layout is None else (layout.rows, layout.cols, layout.groups_per_row)


def is_second_moment(name: str) -> bool:
    """Whether the moment named ``name`` is a second moment (Adam's ``exp_avg_sq``: non-negative, unsigned
    codes, of its square root when companded) rather than a signed one (``exp_avg``, ``momentum_buffer``)."""
    return name.endswith("_sq")


def quantize_moment(name: str, values: torch.Tensor, cols: int, companded: bool):
    """fp32 ``values`` of the moment ``name`` -> (codes of their shape, bf16 scales (rows, groups))."""
    if values.numel() == 0:  # an empty dimension: no groups (the row arithmetic below would divide by 0 cols)
        rows = 0 if cols else (values.shape[0] if values.ndim >= 2 else 1)  # (a flat layout: one row)
        return (torch.empty(values.shape, dtype=QuantizedMoment.code_dtype(name), device=values.device),
                torch.empty((rows, -(-cols // Q.GROUP)), dtype=torch.bfloat16, device=values.device))
    if is_second_moment(name):
        return Q.quantize_exp_avg_sq(values, cols, companded)
    return Q.quantize_exp_avg(values, cols, companded)


def dequantize_moment(name: str, codes: torch.Tensor, scales: torch.Tensor, cols: int, companded: bool):
    """Codes and scales of the moment ``name`` -> fp32 values of the codes' shape."""
    if codes.numel() == 0:
        return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if is_second_moment(name):
        return Q.dequantize_exp_avg_sq(codes, scales, cols, companded)
    return Q.dequantize_exp_avg(codes, scales, cols, companded)


@dataclass(frozen=True)
class QuantizedMoment:
    """The codes and scales of one moment of one parameter, with what it takes to read them.

    ``codes`` has the parameter's shape (int8, or uint8 for a second moment); ``scales`` is bf16 of shape
    ``(rows, groups_per_row)``. Both are DTensors beside a DTensor parameter (true global shapes, the
    parameter's placements, so DCP saves and reshards them) and plain tensors otherwise. The object is a
    view: ``quantize_`` writes into the tensors it holds, which are the optimizer's state tensors when it
    came from ``from_state``."""

    name: str  #: the moment's name in torch.optim's state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``)
    codes: torch.Tensor
    scales: torch.Tensor
    layout: MomentLayout
    companded: bool  #: softsign (first moment) / square root (second) before the linear 8-bit code

    # ----- names in optimizer state -----------------------------------------------------------------------

    @staticmethod
    def keys(name: str) -> tuple[str, str]:
        """The state keys of the codes and the scales of moment ``name``."""
        return f"{name}_{CODES}", f"{name}_{SCALES}"

    @staticmethod
    def codes_key(name: str) -> str:
        return f"{name}_{CODES}"

    @staticmethod
    def scales_key(name: str) -> str:
        return f"{name}_{SCALES}"

    @staticmethod
    def split_key(key: str) -> tuple[str, str | None]:
        """``(moment name, CODES or SCALES)`` for a key written by this type (``"exp_avg_codes"`` ->
        ``("exp_avg", "codes")``), ``(key, None)`` for any other state key (``exp_avg``, ``step``, ``rho``)."""
        for suffix, part in _SUFFIXES.items():
            if key.endswith(suffix):
                return key[: -len(suffix)], part
        return key, None

    @classmethod
    def any_codes(cls, keys) -> bool:
        """Whether any of these state keys holds codes: a state (dict) in the compressed format."""
        return any(cls.split_key(k)[1] == CODES for k in keys)

    @classmethod
    def held_in(cls, state: dict, name: str) -> bool:
        """Whether ``state`` (one parameter's state) keeps moment ``name`` quantized."""
        return cls.codes_key(name) in state

    @staticmethod
    def code_dtype(name: str) -> torch.dtype:
        return torch.uint8 if is_second_moment(name) else torch.int8

    # ----- create, read, write ----------------------------------------------------------------------------

    @classmethod
    def zeros(cls, name: str, p: torch.Tensor, layout: MomentLayout, companded: bool) -> QuantizedMoment:
        """An all-zero moment beside parameter ``p`` (its local shard, on its device; wrapped as DTensor
        state like ``p`` through ``flashdist.distributed.state_like``)."""
        lp = D.local(p)
        codes = torch.zeros_like(lp, dtype=cls.code_dtype(name))
        scales = torch.zeros(layout.local_scales_shape(lp.shape), dtype=torch.bfloat16, device=lp.device)
        return cls(name, D.state_like(p, codes, tuple(D.global_shape(p))),
                   D.state_like(p, scales, (layout.rows, layout.groups_per_row)), layout, companded)

    @classmethod
    def quantize(cls, name: str, values: torch.Tensor, layout: MomentLayout, companded: bool) -> QuantizedMoment:
        """The moment of fp32 ``values`` (plain tensors, whole rows of the layout)."""
        codes, scales = quantize_moment(name, values, layout.cols, companded)
        return cls(name, codes, scales, layout, companded)

    def local_cols(self) -> int:
        """The row length of the local codes (the global one unless tensor parallelism cuts the rows)."""
        return self.layout.local(D.local(self.codes).shape).cols

    def dequantize(self) -> torch.Tensor:
        """The fp32 values of the local codes (the codes' local shape)."""
        return dequantize_moment(self.name, D.local(self.codes), D.local(self.scales), self.local_cols(),
                                 self.companded)

    def quantize_(self, values: torch.Tensor) -> None:
        """Overwrite the local codes and scales with those of fp32 ``values`` (the local rows' values)."""
        if values.numel() == 0:  # an empty dimension: nothing to write (and no scales whose shape to match)
            return
        codes, scales = quantize_moment(self.name, values, self.local_cols(), self.companded)
        D.local(self.codes).copy_(codes)
        D.local(self.scales).copy_(scales)

    def row_slice(self, rows: slice) -> QuantizedMoment:
        """The moment of some whole rows (plain tensors): groups never cross rows, so they (de)quantize as
        they do in the whole moment."""
        codes = self.codes[rows]
        return dataclasses.replace(self, codes=codes, scales=self.scales[rows],
                                   layout=dataclasses.replace(self.layout, rows=codes.shape[0]))

    @staticmethod
    def cat(parts: list[QuantizedMoment]) -> QuantizedMoment:
        """The moment of consecutive row slices, joined (the inverse of ``row_slice``)."""
        if len(parts) == 1:
            return parts[0]
        codes = torch.cat([m.codes for m in parts])
        return dataclasses.replace(parts[0], codes=codes, scales=torch.cat([m.scales for m in parts]),
                                   layout=dataclasses.replace(parts[0].layout, rows=codes.shape[0]))

    # ----- state dicts ------------------------------------------------------------------------------------

    @classmethod
    def from_state(cls, state: dict, name: str, *, flat: bool, companded: bool, pop: bool = False) -> QuantizedMoment:
        """Moment ``name`` of one parameter's ``state`` (its tensors themselves, not copies); ``pop``: and
        remove its keys from ``state``. The layout follows from the codes' (global) shape."""
        codes_key, scales_key = cls.keys(name)
        take = state.pop if pop else state.__getitem__
        codes, scales = take(codes_key), take(scales_key)
        return cls(name, codes, scales, MomentLayout.of(tuple(codes.shape), flat), companded)

    def store(self, state: dict) -> None:
        """Put the codes and scales into one parameter's ``state`` under their keys."""
        codes_key, scales_key = self.keys(self.name)
        state[codes_key] = self.codes
        state[scales_key] = self.scales
