"""Optimizer state-dict formats: portable (default) and compressed, versioned, validated on load.

Portable: per parameter ``step``, each moment dequantized to fp32 under torch.optim's name and the
parameter's shape (``exp_avg``, ``exp_avg_sq``), and ``rho``. It loads into torch.optim.AdamW, into
flashdist at any world size (loading re-quantizes the local rows; row-aligned groups make that the same as
re-quantizing the full tensor), and a torch.optim.AdamW state dict loads into flashdist. Re-quantizing an
unchanged state gives back the same codes and scales.

Compressed (``state_dict_format="compressed"``): the codes, scales and rho themselves, 2.125 + rho bytes
per parameter; under FSDP2 they are DTensors with the parameter's placements and true global shapes, so
torch.distributed.checkpoint reshards them exactly.

Each param group of a saved state dict carries ``flashdist_format``, ``flashdist_version`` and (from
version 2) ``flashdist_param_dtypes``: the dtype of each of its parameters, which rho's meaning depends on.
A state loaded into a parameter of another dtype is converted through the exact master where that is exact
(bf16/fp16 + rho into fp32: the parameter becomes the master; fp32 into bf16/fp16: rho 0, the weights are
their own master) and refused between bf16 and fp16. A version-1 state dict (no dtypes) is taken as saved
for the parameters' current dtypes.
"""

from __future__ import annotations

import math

import torch

from .. import distributed as D
from ..quant.moment import QuantizedMoment, dequantize_moment, is_second_moment, quantize_moment
from ..quant import rho as R
from .layout import LAYOUT_OPTIONS
from .params import param_name

FORMAT_VERSION = 2  # 2: param groups record the dtype of each parameter (flashdist_param_dtypes)
FORMATS = ("portable", "compressed")
LAYOUT_KEYS = LAYOUT_OPTIONS
_META_KEYS = ("flashdist_format", "flashdist_version", "flashdist_param_dtypes")
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.bfloat16, torch.float16, torch.float32)}
_KEPT_GROUP_KEYS = ("params", "param_names") + _META_KEYS + LAYOUT_KEYS  # not taken from a loaded group

__all__ = ["FORMATS", "FORMAT_VERSION", "LAYOUT_KEYS", "dequantize_moment", "export_state_dict", "load_state_dict",
           "quantize_moment"]


def _params_in_order(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            yield group, p


def export_state_dict(opt, sd: dict, fmt: str) -> dict:
    """Rewrite ``sd`` (torch's ``Optimizer.state_dict()`` of a flashdist optimizer) into format ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"flashdist: state_dict_format must be one of {FORMATS}, got {fmt!r}")
    for sgroup, group in zip(sd["param_groups"], opt.param_groups):
        sgroup["flashdist_format"] = fmt
        sgroup["flashdist_version"] = FORMAT_VERSION
        sgroup["flashdist_param_dtypes"] = [str(p.dtype).removeprefix("torch.") for p in group["params"]]
    for index, (group, p) in enumerate(_params_in_order(opt)):
        entry = sd["state"].get(index)
        if entry is None:
            continue
        # torch's state_dict() shares the live per-param dicts; the step counts are 0-d views of one
        # tensor per step plan (a saved view would carry the whole storage): copy both
        entry = sd["state"][index] = dict(entry)
        if isinstance(entry.get("step"), torch.Tensor):
            entry["step"] = entry["step"].clone()
        names = opt.moments_of(group)
        if fmt == "compressed" or not names or not QuantizedMoment.held_in(entry, names[0]):
            continue
        for name in names:
            moment = QuantizedMoment.from_state(entry, name, flat=group.get("flat_layout", False),
                                                companded=group["companded"], pop=True)
            entry[name] = D.state_like(p, moment.dequantize(), tuple(D.global_shape(p)))
    return sd


def _local_for(value, mine: torch.Tensor) -> torch.Tensor:
    """The part of a loaded tensor that this rank holds for state tensor ``mine``."""
    if D.is_dtensor(value):
        if D.is_dtensor(mine) and (value.device_mesh != mine.device_mesh or value.placements != mine.placements):
            value = value.redistribute(mine.device_mesh, mine.placements)  # a state dict sharded differently
        elif not D.is_dtensor(mine):
            value = value.full_tensor()
        return D.local(value)
    if D.is_dtensor(mine):  # a full (unsharded) tensor loaded into a sharded optimizer
        return D.local_rows(value, mine)
    return value


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"flashdist: {message}")


def _check_values(name: str, key: str, value: torch.Tensor, *, non_negative: bool) -> None:
    """Refuse loaded moment values (or scales) that are NaN or infinite, or negative where they cannot be: a
    step that reads them skips its group every time (the non-finite guard), so they would freeze it."""
    if value.numel() == 0:
        return
    bad = ~torch.isfinite(value)
    if non_negative:
        bad |= value < 0
    if bool(bad.any()):
        first = value.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
        what = "finite and non-negative" if non_negative else "finite"
        raise ValueError(f"flashdist: state '{key}' of {name} holds {int(bad.sum())} values that are not {what} "
                         f"(e.g. {first!r}); the checkpoint is damaged: load an earlier one")


def _rho_from_torch(value, rho_dtype: torch.dtype, name: str):
    """rho as flashdist keeps it, from a state dict that went through a torch optimizer's ``load_state_dict``
    (FlashMuon's into torch.optim.Muon and back, FlashAdamW's into torch.optim.AdamW): torch casts every state
    tensor but ``step`` to the parameter's dtype, which holds every int8 value exactly (bf16, fp16) but not
    every int16 one. Taken back where the cast was exact; anything else is returned as it came."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    _check(value.dtype in R.EXACT_CASTS.get(rho_dtype, ()),
           f"state 'rho' of {name} is {value.dtype}, which does not hold every {rho_dtype} value (a torch "
           "optimizer's load_state_dict casts rho to the parameter's dtype): load the state dict flashdist saved, "
           "or start from its fp32 masters (flashdist export, then flashdist.load_fp32_state_dict)")
    local = R.from_float(D.local(value), rho_dtype)
    _check(local is not None, f"state 'rho' of {name} is {value.dtype} with values that are not whole numbers in "
                              f"[{torch.iinfo(rho_dtype).min}, {torch.iinfo(rho_dtype).max}]: the file is damaged "
                              "or was edited")
    return value.to(rho_dtype)


def _plan_param(opt, group, p, name, saved: dict, saved_dtype: torch.dtype | None = None) -> list:
    """Validate one parameter's saved state; return a list of (destination local tensor, source) copies.
    ``saved_dtype``: the dtype of the parameter the state was saved for (None: not recorded)."""
    mine = opt.state[p]
    if any(isinstance(v, dict) and not v for v in saved.values()):
        # torch.distributed.checkpoint.state_dict rebuilds a FLATTENED optimizer state dict from the keys of
        # the live optimizer state (exp_avg_codes, ...), so the portable keys (exp_avg, ...) never arrive.
        raise ValueError(f"flashdist: the state of {name} came through flatten_optimizer_state_dict=True, which "
                         "can only carry the compressed format (torch rebuilds it from the live state's keys). "
                         "Build the optimizer with state_dict_format='compressed' (it reshards exactly across "
                         "world sizes too), or save without flatten_optimizer_state_dict.")
    names = opt.moments_of(group)
    quantized = bool(names) and QuantizedMoment.held_in(mine, names[0])
    shape = tuple(D.global_shape(p))
    ops = []
    keys = set(saved)
    compressed_keys = {key for m in names for key in QuantizedMoment.keys(m)}
    portable_keys = set(names)
    extra = keys - compressed_keys - portable_keys - {"step", "rho"}
    _check(not extra, f"state of {name} has unexpected keys {sorted(extra)} (expected {sorted(mine)}); "
                      "was it saved by another optimizer (e.g. AdamW with amsgrad)?")
    if "step" not in saved and not opt.keeps_step_count and keys & portable_keys:
        # torch.optim.SGD keeps no step count; a saved momentum buffer means at least one step was taken
        saved = {**saved, "step": 1.0}
    _check(bool(saved), f"state of {name} is empty: with flatten_optimizer_state_dict=True torch rebuilds each "
                        "parameter's state from the keys of the live state, and this optimizer has none yet; call "
                        "optimizer.state_dict() first (it makes the state, as get_optimizer_state_dict does), or "
                        "load without flatten_optimizer_state_dict")
    _check("step" in saved, f"state of {name} has no 'step'")
    if keys & compressed_keys:
        _check(quantized, f"state of {name} is compressed (codes and scales) but this optimizer keeps its "
                          "moments in fp32 (quantize_states=False or a 1-d parameter); build it with the settings "
                          "the checkpoint was saved with, or save it in the portable format")
        _check(compressed_keys <= keys, f"state of {name} lacks {sorted(compressed_keys - keys)}")
        for key in sorted(compressed_keys):
            value = saved[key]
            _check(isinstance(value, torch.Tensor), f"state '{key}' of {name} is not a tensor")
            _check(tuple(value.shape) == tuple(mine[key].shape) and value.dtype == mine[key].dtype,
                   f"state '{key}' of {name} is {value.dtype} {tuple(value.shape)}, expected "
                   f"{mine[key].dtype} {tuple(mine[key].shape)}")
            ops.append(("copy", D.local(mine[key]), value, mine[key]))
    else:
        _check(portable_keys <= keys, f"state of {name} lacks {sorted(portable_keys - keys)} "
                                      f"(has {sorted(keys)})")
        for m in names:
            value = saved[m]
            _check(isinstance(value, torch.Tensor) and value.is_floating_point(),
                   f"state '{m}' of {name} must be a floating-point tensor")
            _check(tuple(value.shape) == shape, f"state '{m}' of {name} has shape {tuple(value.shape)}, "
                                                f"the parameter has {shape}")
            if quantized:
                ops.append(("quantize", m, value, mine))
            else:
                ops.append(("copy", D.local(mine[m]), value, mine[m]))
    converted = saved_dtype is not None and saved_dtype != p.dtype
    if converted:
        half = (torch.bfloat16, torch.float16)
        _check(not (saved_dtype in half and p.dtype in half),
               f"state of {name} was saved for a {saved_dtype} parameter and this one is {p.dtype}: rho corrects "
               f"{saved_dtype} values and no exact {p.dtype} master can be rebuilt from a cast copy; load it "
               f"into the dtype it was saved for, or start from its fp32 masters (flashdist export, then "
               f"flashdist.load_fp32_state_dict)")
    if "rho" in saved and converted and "rho" not in mine:
        # a bf16/fp16 parameter saved with rho, loaded into an fp32 one (PEFT's load_adapter upcasts): the
        # parameter, an exact upcast of the saved one, becomes the saved master weight
        value = saved["rho"]
        _check(isinstance(value, torch.Tensor) and value.dtype in (torch.int8, torch.int16)
               and tuple(value.shape) == shape, f"state 'rho' of {name} is not an int8/int16 tensor of {shape}")
        lp = D.local(p)
        _check(torch.equal(lp.to(saved_dtype).to(lp.dtype), lp),
               f"state of {name} holds rho for a {saved_dtype} parameter and this {p.dtype} parameter does not hold "
               f"{saved_dtype} values, so its master cannot be rebuilt: load the model's weights before the "
               "optimizer's state (as the Trainer and Accelerate do)")
        ops.append(("master", p, value, saved_dtype))
    elif converted and "rho" in mine and "rho" not in saved:
        # an fp32 parameter's state loaded into a bf16/fp16 one: its weights are their own master
        ops.append(("zero", D.local(mine["rho"]), None, None))
    elif "rho" in saved:
        value = saved["rho"]
        _check("rho" in mine, f"state of {name} has 'rho' but this optimizer keeps no rho for it "
                              f"(master_weight_bits={group['master_weight_bits']}, {p.dtype})")
        value = _rho_from_torch(value, mine["rho"].dtype, name)
        _check(isinstance(value, torch.Tensor) and value.dtype == mine["rho"].dtype and tuple(value.shape) == shape,
               f"state 'rho' of {name} is {getattr(value, 'dtype', type(value))} "
               f"{tuple(getattr(value, 'shape', ()))}, expected {mine['rho'].dtype} {shape}")
        ops.append(("copy", D.local(mine["rho"]), value, mine["rho"]))
    step = saved["step"]
    _check(isinstance(step, (int, float)) or (isinstance(step, torch.Tensor) and step.numel() == 1),
           f"state 'step' of {name} must be a number")
    count = float(step)
    _check(math.isfinite(count) and count >= 0 and count.is_integer(),
           f"state 'step' of {name} is {count!r}; a step count is a non-negative whole number (the file is "
           "damaged or was edited)")
    for key, value in saved.items():
        if key in ("step", "rho") or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        _check_values(name, key, D.local(value), non_negative=is_second_moment(key) or key.endswith("_scales"))
    ops.append(("step", mine["step"], step, None))
    return ops


def _grouped_otherwise(live: list[dict], saved: list[dict]) -> str | None:
    """Where the saved groups and the live ones both name their parameters (``param_names``), the same names
    grouped or ordered otherwise, which a load by position would mix (or refuse with a misleading count): what
    to say, or None."""
    names = [[g.get("param_names") or [] for g in groups if isinstance(g, dict)] for groups in (live, saved)]
    if not all(isinstance(group, list) for side in names for group in side):
        return None  # (a file's own business: the checks that follow refuse what is malformed)
    flat = [[n for group in side for n in group] for side in names]
    if (names[0] == names[1] or not all(flat) or not all(isinstance(n, str) for n in flat[1])
            or sorted(flat[0]) != sorted(flat[1])):
        return None
    where = {n: (gi, i) for gi, group in enumerate(names[1]) for i, n in enumerate(group)}
    moved = next(((n, (gi, i)) for gi, group in enumerate(names[0]) for i, n in enumerate(group)
                  if where[n] != (gi, i)), None)
    if moved is None:  # (only empty groups differ: the group count says it)
        return None
    name, here = moved
    return (f"the state dict holds this optimizer's parameters grouped or ordered otherwise (by param_names): "
            f"'{name}' is param_groups[{where[name][0]}]['params'][{where[name][1]}] there and "
            f"param_groups[{here[0]}]['params'][{here[1]}] here (groups built by an earlier muon_param_groups? "
            "docs/method.md says which rules changed when); build the groups as the checkpoint's param_names say")


def load_state_dict(opt, sd: dict) -> None:
    """Load ``sd`` (portable, compressed or torch.optim.AdamW's) into ``opt``; all checks run first."""
    _check(isinstance(sd, dict) and isinstance(sd.get("param_groups"), list) and isinstance(sd.get("state"), dict),
           "load_state_dict expects a dict with 'state' and 'param_groups'")
    groups, saved = sd["param_groups"], sd["state"]
    regrouped = _grouped_otherwise(opt.param_groups, groups)
    _check(regrouped is None, regrouped)
    _check(len(groups) == len(opt.param_groups),
           f"the state dict has {len(groups)} param groups, this optimizer has {len(opt.param_groups)}")
    plan = []
    index = 0
    for gi, (group, sgroup) in enumerate(zip(opt.param_groups, groups)):
        opt._check_saved_group(gi, sgroup)
        version = sgroup.get("flashdist_version", FORMAT_VERSION)
        _check(isinstance(version, int) and version <= FORMAT_VERSION,
               f"param group {gi} was saved in state-dict format version {version!r}; this flashdist reads "
               f"versions up to {FORMAT_VERSION}: upgrade flashdist")
        _check(len(sgroup["params"]) == len(group["params"]),
               f"param group {gi} has {len(sgroup['params'])} parameters in the state dict and "
               f"{len(group['params'])} here: is this checkpoint from another model?")
        if "flashdist_format" in sgroup:
            for key in ("master_weight_bits",):
                _check(sgroup.get(key, group[key]) == group[key],
                       f"param group {gi} was saved with {key}={sgroup.get(key)!r}, this optimizer has "
                       f"{key}={group[key]!r}; build the optimizer with the same setting")
        dtypes = sgroup.get("flashdist_param_dtypes")
        _check(dtypes is None or (isinstance(dtypes, list) and all(d in _DTYPES for d in dtypes)),
               f"param group {gi}'s flashdist_param_dtypes must name one of {sorted(_DTYPES)} per parameter, "
               f"got {dtypes!r}")
        if dtypes is not None and len(dtypes) != len(sgroup["params"]):
            # torch.distributed.checkpoint rebuilds param groups from the loading optimizer's, and may hand
            # back that optimizer's own record for another grouping: taken as not recorded
            dtypes = None
        for i, (pid, p) in enumerate(zip(sgroup["params"], group["params"])):
            if pid in saved:
                opt.ensure_state(p, group)  # flat_layout groups create their state lazily
                name = param_name(group, i, p, opt.param_groups)
                plan.extend((op, group) for op in _plan_param(opt, group, p, name, saved[pid],
                                                              _DTYPES[dtypes[i]] if dtypes else None))
            index += 1
    # The hyper-parameters the groups will have after the load (torch's load_state_dict takes the saved
    # ones), checked too: e.g. FlashSGD refuses a momentum switched on or off under the state it holds.
    for group, sgroup in zip(opt.param_groups, groups):
        opt.check_group({**group, **{k: v for k, v in sgroup.items() if k not in _KEPT_GROUP_KEYS}})
    # Everything checked: apply.
    with torch.no_grad():
        _apply(plan)
    for group, sgroup in zip(opt.param_groups, groups):
        for k, v in sgroup.items():
            if k not in _KEPT_GROUP_KEYS:
                group[k] = v


def _apply(plan: list) -> None:
    for (kind, dest, value, mine), group in plan:
        if kind == "copy":
            dest.copy_(_local_for(value, mine))
        elif kind == "step":
            dest.fill_(float(value))
        elif kind == "zero":
            dest.zero_()
        elif kind == "master":  # dest: the fp32 parameter; mine: the dtype the state was saved for
            lp = D.local(dest)
            lp.copy_(R.merge(lp.to(mine), _local_for(value, dest).to(lp.device)))
        else:  # re-quantize a portable moment under this optimizer's sharding
            moment = QuantizedMoment.from_state(mine, dest, flat=group.get("flat_layout", False),
                                                companded=group["companded"])
            moment.quantize_(_local_for(value, moment.codes).to(D.local(moment.codes).device, torch.float32))
