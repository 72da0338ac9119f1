"""Which FSDP2 parameter group (one ``fully_shard`` call, one reduce-scatter) holds each parameter.

FSDP2 keeps its groups in per-module state that torch 2.13 exposes through no public accessor
(``FSDPModule._get_fsdp_state()._fsdp_param_groups``, ``_fsdp_param_group`` before torch 2.12). Gradient
release reads them here; ``flashdist.distributed.fsdp_compute_dtypes`` reads their mixed-precision policy.
"""

from __future__ import annotations

import torch


def _fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _param_groups(fsdp_module: torch.nn.Module) -> list:
    """FSDP2's parameter groups (one reduce-scatter each) of one ``fully_shard`` module."""
    state = fsdp_module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: at most one group per module
        one = state._fsdp_param_group
        groups = [one] if one is not None else []
    return groups


def fsdp_units(model: torch.nn.Module) -> dict[int, int]:
    """``id(param) -> unit`` for every parameter that an FSDP2 parameter group (one ``fully_shard`` call,
    one reduce-scatter) manages; units are numbered from 0 in module order. Parameters outside FSDP2 are
    absent.

    FSDP2's own record is the authority; where it is missing (its private names moved) the module
    structure gives the same answer: a parameter belongs to the innermost ``fully_shard`` module above it."""
    fsdp_modules = _fsdp_modules(model)
    if not fsdp_modules:
        return {}
    unit_of: dict[int, int] = {}
    try:
        groups, seen = [], set()
        for module in fsdp_modules:
            for pg in _param_groups(module):
                if id(pg) not in seen:
                    seen.add(id(pg))
                    groups.append(pg)
        for unit, pg in enumerate(groups):
            for fsdp_param in pg.fsdp_params:
                unit_of[id(fsdp_param.sharded_param)] = unit
        return unit_of
    except (AttributeError, AssertionError, TypeError):  # private API moved: derive it from the modules
        unit_of.clear()
    index = {id(m): i for i, m in enumerate(fsdp_modules)}

    def walk(module: torch.nn.Module, unit: int | None) -> None:
        unit = index.get(id(module), unit)
        if unit is not None:
            for p in module.parameters(recurse=False):
                unit_of.setdefault(id(p), unit)
        for child in module.children():
            walk(child, unit)

    walk(model, None)
    return unit_of
