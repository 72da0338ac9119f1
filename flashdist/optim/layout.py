"""The layout options of a param group: the settings that decide what state its parameters keep.

They are fixed once a group's state exists (the state's dtypes and shapes follow from them), so the
optimizer reads them from the group dict once, through :class:`LayoutOptions`, and refuses a live group
whose options changed. Param-group dicts keep them as plain keys, as torch optimizers keep theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..quant.rho import RHO_DTYPES

MASTER_WEIGHT_BITS = (*RHO_DTYPES, None)  # 24: int8 rho, 32: int16 rho, None: no rho


def check_master_weight_bits(value, *, name: str = "master_weight_bits", allow_none: bool = True,
                             error: type[Exception] = ValueError):
    """Return ``value`` when it is an allowed ``master_weight_bits`` (24, 32, or None when ``allow_none``),
    else raise ``error`` naming ``name`` (the parameter or file field a caller reads it from)."""
    allowed = MASTER_WEIGHT_BITS if allow_none else tuple(b for b in MASTER_WEIGHT_BITS if b is not None)
    if value not in allowed:
        words = ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}"
        raise error(f"flashdist: {name} must be {words}, got {value!r}")
    return value


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"flashdist: {name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class LayoutOptions:
    """What state the parameters of one param group keep. Validated on creation; immutable (hashable, and
    equal when every option is)."""

    master_weight_bits: int | None = 24
    """Bits of the master weight rebuilt from a bf16/fp16 parameter and its rho: 24 (int8 rho), 32 (int16
    rho) or None (no rho; the parameter is the weight). fp32 parameters keep no rho whatever the value."""

    quantize_states: bool = True
    """Keep the moments as 8-bit codes with a bf16 scale per group of 32 values (True) or in fp32."""

    companded: bool = True
    """Softsign (first moment) and square-root (second moment) companding before the 8-bit quantization;
    False: plain linear group absmax for both."""

    flat_layout: bool = False
    """Quantize each tensor as one row of ``numel`` values (DeepSpeed's flat 1-d partitions) instead of
    row-aligned groups; its state is created at its first step."""

    def __post_init__(self) -> None:
        check_master_weight_bits(self.master_weight_bits)
        _check_bool("quantize_states", self.quantize_states)
        _check_bool("companded", self.companded)
        _check_bool("flat_layout", self.flat_layout)

    @classmethod
    def from_group(cls, group: dict) -> LayoutOptions:
        """The options of a param-group dict, validated (``flat_layout`` may be absent: False)."""
        return cls(group["master_weight_bits"], group["quantize_states"], group["companded"],
                   group.get("flat_layout", False))

    def matches(self, group: dict) -> bool:
        """Whether ``group`` holds these options now (no validation: cheap enough for every step)."""
        return (group["master_weight_bits"] == self.master_weight_bits
                and group["quantize_states"] == self.quantize_states and group["companded"] == self.companded
                and group.get("flat_layout", False) == self.flat_layout)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


LAYOUT_OPTIONS = tuple(f.name for f in dataclasses.fields(LayoutOptions))
