"""Which model weight each optimizer state belongs to, in a checkpoint read without the model: the step that
makes an export's master weights (``param + rho``) those of the live optimizer, or refuses in one line.

A checkpoint is a nested dict ``{"model": {fqn: tensor}, "optim": {"state": {key: {...}}, "param_groups":
[...]}}`` (``"optimizer"`` is accepted for ``"optim"``). Its state is keyed one of two ways:

- by FQN (:func:`flashdist.checkpoint.save`, ``flashdist convert``): each key names its model weight.
- by index (``optimizer.state_dict()`` as torch writes it, e.g. ``torch.save({"model": ..., "optim": ...})`` or a
  Trainer's ``optimizer.pt``). The names come from the param groups' ``param_names`` when every group has them
  (torch >= 2.6 writes them for an optimizer built from ``named_parameters()``). Otherwise from the model's
  parameter order, under one assumption that nothing in the file can check: each param group lists its
  parameters in the model's order (``model.parameters()``, a filter of ``named_parameters()``, the Trainer's
  decay / no-decay groups). Each group's parameters are then matched, in order, to the model's floating-point
  weights of the same shape (a parameter with rho to a bf16/fp16 weight); the match must be the only one
  (tied weights, frozen parameters and buffers are skipped only where no other reading fits), else refused.

Every rho must be attached to a bf16/fp16 model weight: a rho that no exported weight uses is an error naming
its state keys (an export without it would write the 16-bit weights as the masters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..quant import rho as R
from .errors import CheckpointError
from .output import Spec

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_SHAPED = ("rho", "exp_avg", "exp_avg_sq", "momentum_buffer")  # state fields with the parameter's shape
_FIX = ("build the optimizer from model.named_parameters() (torch >= 2.6 saves param_names) or save with "
        "flashdist.checkpoint.save (state keyed by name)")


TIED = "flashdist_tied"
"""Key of a checkpoint's ``extra`` that :func:`flashdist.checkpoint.save` writes: the model's tied weights, as
lists of the names one tensor is saved under (empty: none), which an export gives one master weight; a weight
it does not list is its own, whatever its values. A user's ``extra`` cannot hold this key."""


def is_ties(value) -> bool:
    """Whether ``value`` is a ``TIED`` record: lists of two or more names."""
    return isinstance(value, list) and all(isinstance(v, list) and len(v) >= 2 and all(isinstance(n, str) for n in v)
                                           for v in value)


def state_dict_ties(model_state: dict) -> list[list[str]]:
    """The ``TIED`` record of a model state dict (``get_model_state_dict``'s, whose names a checkpoint keeps):
    the names whose tensors (a DTensor's local one) are one storage at one place."""
    from .. import distributed as D  # noqa: PLC0415

    by_place: dict[tuple, list[str]] = {}
    for name, value in model_state.items():
        if isinstance(value, torch.Tensor):
            by_place.setdefault(storage_place(D.local(value)), []).append(name)
    return [names for names in by_place.values() if len(names) > 1]


def storage_place(t: torch.Tensor) -> tuple:
    """Where ``t``'s values are: equal for two tensors that are one tensor (a weight tied under two names)."""
    return t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


ORDER_UNKNOWN = "flashdist_model_order_unknown"
"""Key of a checkpoint's ``extra``: why its model entries are not in the model's parameter order (a folder whose
weight files sort their keys, read without the model), kept by ``read`` and ``convert`` so that a later export
never takes that order for the model's."""


@dataclass
class Owners:
    """The model weights of a checkpoint and the rho of each: ``model`` FQN -> route of the weight, ``rho`` FQN
    -> route of its rho, ``optim_names`` every state key -> the FQN it belongs to, ``how`` how the names were
    found (``"names"``, ``"param_names"``, ``"model order"`` or ``"no optimizer state"``)."""

    model: dict[str, tuple]
    rho: dict[str, tuple]
    optim_names: dict[Any, str]
    how: str
    rho_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    """FQN -> the dtype its rho is read as (int8: 24-bit masters, int16: 32-bit), where the file holds a
    torch optimizer's floating cast of it (its load_state_dict casts rho to the parameter's dtype)."""


def optim_key(rest) -> str | None:
    """The top-level key of the optimizer state dict in a checkpoint: "optim" or "optimizer"."""
    if not isinstance(rest, dict):
        return None
    return next((k for k in ("optim", "optimizer") if isinstance(rest.get(k), dict)), None)


def owners(rest, specs: dict[tuple, Spec], model_order: list[str] | None = None,
           order_unknown: str | None = None) -> Owners:
    """Attach every optimizer state of a checkpoint (``rest``: its plain data, ``specs``: route -> (shape,
    dtype) of each tensor) to its model weight, or raise :class:`CheckpointError` in one line.
    ``model_order``: the model's parameter FQNs in ``named_parameters()`` order where the checkpoint's own
    order is not it (a safetensors file lists its tensors sorted by name); default: the order of ``specs``.
    ``order_unknown``: why neither order is the model's (then only names and ``param_names`` can be used)."""
    model = {route[1]: route for route in specs if route[0] == "model" and len(route) == 2}
    extra = rest.get("extra") if isinstance(rest, dict) else None
    if order_unknown is None and model_order is None and isinstance(extra, dict) and extra.get(ORDER_UNKNOWN):
        order_unknown = str(extra[ORDER_UNKNOWN])
    okey = optim_key(rest)
    optim = rest[okey] if okey else {}
    state_keys: dict[Any, dict[str, tuple]] = {}
    for route in specs:
        if okey and len(route) == 4 and route[:2] == (okey, "state"):
            state_keys.setdefault(route[2], {})[route[3]] = route
    for key in (optim.get("state") or {}):
        state_keys.setdefault(key, {})
    groups = [g for g in optim.get("param_groups") or [] if isinstance(g, dict)]
    if not state_keys and not groups:
        return Owners(model, {}, {}, "no optimizer state")
    listed = [k for g in groups for k in g.get("params", [])]
    if all(isinstance(k, str) for k in list(state_keys) + listed):
        names, how = {k: k for k in list(state_keys) + listed}, "names"
    elif groups and all(isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g.get("params", []))
                        for g in groups):
        names, how = {k: n for g in groups for k, n in zip(g["params"], g["param_names"])}, "param_names"
        absent = sorted({n for n in names.values() if n not in model})
        if absent:
            raise CheckpointError(f"flashdist: the optimizer's param_names {absent[:4]} are not among the model "
                                  "weights; are the model and the optimizer state from one model?")
    elif order_unknown:
        raise CheckpointError(f"flashdist: the optimizer state is keyed by index without param_names and the model's "
                              f"parameter order is unknown: {order_unknown}; {_FIX}")
    else:
        names, how = _by_model_order(groups, state_keys, specs, model, model_order), "model order"
    used = [n for n in names.values()]
    if len(set(used)) != len(used):
        twice = sorted({n for n in used if used.count(n) > 1})
        raise CheckpointError(f"flashdist: model weights {twice[:4]} are named for two optimizer parameters")
    bits = {k: g.get("master_weight_bits") for g in groups for k in g.get("params", [])}
    rho, rho_dtype, unused = {}, {}, []
    for key, fields in state_keys.items():
        if "rho" not in fields:
            continue
        name = names.get(key)
        if (name is None or name not in model or specs[model[name]][1] not in SIXTEEN_BIT
                or tuple(specs[fields["rho"]][0]) != tuple(specs[model[name]][0])):
            unused.append(key)
            continue
        rho[name] = fields["rho"]
        rho_dtype[name] = _rho_read_as(specs[fields["rho"]][1], bits.get(key), key)
    if unused:
        raise CheckpointError(f"flashdist: rho of optimizer state {sorted(map(str, unused))[:6]}"
                              f"{' ...' if len(unused) > 6 else ''} belongs to no bf16/fp16 model weight: the "
                              f"masters cannot be attached ({how}); {_FIX}")
    return Owners(model, rho, names, how, rho_dtype)


def _rho_read_as(dtype: torch.dtype, bits, key) -> torch.dtype:
    """The rho dtype a saved rho of ``dtype`` holds: its own (int8, int16), or for a torch optimizer's floating
    cast of it the one its group's ``master_weight_bits`` names (unrecorded: int8, where the cast is 16-bit),
    where that cast holds every value of it (``quant.rho.EXACT_CASTS``)."""
    if dtype in R.RHO_STEPS:
        return dtype
    where, dtype_name = f"flashdist: rho of optimizer state {str(key)[:80]!r}", str(dtype).removeprefix("torch.")
    if not dtype.is_floating_point:
        raise CheckpointError(f"{where} is {dtype_name}: not a dtype flashdist writes rho in (int8, int16) nor a "
                              "torch optimizer's cast of one; the file is damaged or crafted")
    rho = R.RHO_DTYPES.get(bits, torch.int8 if dtype in SIXTEEN_BIT else None)
    if rho is None:
        raise CheckpointError(f"{where} is {dtype_name}: its param group records no master_weight_bits (24 or 32) "
                              "to read it by")
    if dtype not in R.EXACT_CASTS[rho]:
        raise CheckpointError(f"{where} is {dtype_name}, which does not hold every {str(rho).removeprefix('torch.')} "
                              f"value of {bits}-bit masters (a torch optimizer's load_state_dict casts rho to the "
                              "parameter's dtype): export the state dict flashdist saved")
    return rho


def _hint(fields: dict[str, tuple], specs: dict[tuple, Spec], flat: bool) -> tuple[tuple | None, bool]:
    """What a parameter's state tells of it: its shape (None: nothing says) and whether it has rho (then its
    weight is bf16/fp16)."""
    shapes = {specs[r][0] for k, r in fields.items() if k in _SHAPED or (k.endswith("_codes") and not flat)}
    if len(shapes) > 1:
        raise CheckpointError(f"flashdist: an optimizer state holds tensors of shapes {sorted(shapes)}: not one "
                              "parameter's state")
    return (shapes.pop() if shapes else None), "rho" in fields


def _by_model_order(groups: list[dict], state_keys: dict, specs: dict[tuple, Spec], model: dict[str, tuple],
                    model_order: list[str] | None) -> dict[Any, str]:
    order = [n for n in (model_order if model_order is not None else model) if n in model]
    entries = [(n, specs[model[n]]) for n in order if specs[model[n]][1].is_floating_point]
    listed = {k for g in groups for k in g.get("params", [])}
    orphans = [k for k in state_keys if k not in listed]
    if orphans:
        raise CheckpointError(f"flashdist: optimizer state {sorted(map(str, orphans))[:6]} is in no param group: "
                              f"its parameter cannot be named; {_FIX}")

    def fits(hint, spec: Spec) -> bool:
        (shape, has_rho), (have, dtype) = hint, spec
        return (shape is None or tuple(shape) == tuple(have)) and (not has_rho or dtype in SIXTEEN_BIT)

    names: dict[Any, str] = {}
    for gi, group in enumerate(groups):
        ids = list(group.get("params", []))
        hints = [_hint(state_keys.get(k, {}), specs, bool(group.get("flat_layout"))) for k in ids]
        # order-preserving matches of the group's parameters among the model's weights, counted (capped at 2)
        ways = [1] * (len(entries) + 1)
        for hint in hints:
            nxt = [0] * (len(entries) + 1)
            for j, (_, spec) in enumerate(entries):
                nxt[j + 1] = min(2, nxt[j] + (ways[j] if fits(hint, spec) else 0))
            ways = nxt
        if ways[-1] != 1:
            why = ("no model weights of these shapes in this order" if ways[-1] == 0 else
                   "more than one way to match them (same-shaped weights skipped: frozen, tied or buffers)")
            raise CheckpointError(f"flashdist: the optimizer state is keyed by index without param_names, and "
                                  f"param group {gi}'s {len(ids)} parameters give {why}; {_FIX}")
        j = 0
        for key, hint in zip(ids, hints):  # the first match of each in turn is the only one
            while not fits(hint, entries[j][1]):
                j += 1
            names[key] = entries[j][0]
            j += 1
    return names
