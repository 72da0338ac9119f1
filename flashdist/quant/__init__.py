"""Quantized optimizer state: group-wise 8-bit moment codes and the rho weight-splitting correction."""

from .codes import GROUP, quantized_layout
from .moment import MomentLayout, QuantizedMoment
from .rho import RHO_DTYPES, splits

__all__ = ["GROUP", "RHO_DTYPES", "MomentLayout", "QuantizedMoment", "quantized_layout", "splits"]
