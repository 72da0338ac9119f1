"""Optimizer state-dict formats (portable and compressed): defined in ``flashdist.optim.state_dict``, which
the optimizer's own ``state_dict`` and ``load_state_dict`` use; importable from here as well."""

from ..optim.state_dict import (FORMAT_VERSION, FORMATS, LAYOUT_KEYS, dequantize_moment, export_state_dict,
                                load_state_dict, quantize_moment)

__all__ = ["FORMATS", "FORMAT_VERSION", "LAYOUT_KEYS", "dequantize_moment", "export_state_dict", "load_state_dict",
           "quantize_moment"]
