"""How a parameter is named in flashdist's messages (shared by the optimizer and its state-dict loading)."""

from __future__ import annotations

import torch


def param_name(group: dict, index: int, p: torch.Tensor) -> str:
    """The parameter's name when the optimizer was given ``named_parameters()``, else its position."""
    names = group.get("param_names")
    where = f"'{names[index]}'" if names else f"param_groups[...]['params'][{index}]"
    return f"{where} (shape {tuple(p.shape)}, {p.dtype})"
