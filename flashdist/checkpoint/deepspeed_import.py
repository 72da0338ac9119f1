"""DeepSpeed ZeRO 1/2/3 checkpoints of a flashdist optimizer -> the checkpoint dict of ``flashdist.checkpoint``.

:func:`read_deepspeed` reads the folder that ``engine.save_checkpoint`` wrote (every rank's
``*_optim_states.pt`` and the model-states files) and returns the nested dict that
:func:`flashdist.checkpoint.save` writes for FSDP2 + a flashdist optimizer, tensors full and on the CPU::

    {"model": {fqn: parameter in the model's dtype (bf16) or buffer},
     "optim": {"state": {fqn: {"step", moments..., "rho"}}, "param_groups": [{..., "params": [fqn, ...]}]},
     "extra": {"step": engine.global_steps}}

The moments are the optimizer's own: ``exp_avg`` and ``exp_avg_sq`` (FlashAdamW, FlashAdam), ``momentum_buffer``
(FlashSGD, FlashSGDW; none without momentum), ``exp_avg`` (FlashLion). Written as DCP (``flashdist convert SRC DST
--to dcp``), it loads with ``flashdist.checkpoint.load`` into FSDP2 + the same optimizer at any world size.

How. DeepSpeed keeps one flat master partition per param group (ZeRO 3: per sub-group) and rank; the
optimizer's state of that partition (flashdist's portable state dict, or the compressed one) has the
partition's shape. Each per-partition tensor (master, rho, each moment, the step) is reassembled per
parameter the way DeepSpeed's ``zero_to_fp32`` reassembles the masters: ZeRO 1/2 concatenate the ranks'
partitions of a group and cut it by the model's parameter shapes (plus DeepSpeed's alignment paddings);
ZeRO 3 takes ``ceil(numel / world)`` values of each parameter from each rank. The 24-bit (or fp32) master
weight ``theta`` is the fp32 master partition, or the bf16 master partition plus rho
(``bf16_master_weights_and_grads``); each parameter is then split into the model's dtype plus rho
(``master_weight_bits`` 24: int8, 32: int16). In the bf16-master mode with 24 bits that gives back
DeepSpeed's bf16 master and rho exactly; fp32 masters keep 24 bits (or all 32 with ``master_weight_bits=32``).
Moments travel as fp32 (the portable format) and are re-quantized by the loading optimizer in its
row-aligned groups of 32, which differ from DeepSpeed's flat groups.

Safety and the folder layout: :mod:`flashdist.checkpoint.deepspeed_files` (the one reader of DeepSpeed's
files: ``torch.load(weights_only=True)`` with DeepSpeed's own few classes allowed, DeepSpeed not needed). Every
check runs before anything is written: a rank's file missing, a file of another world size, a ZeRO stage other
than 1-3, an optimizer that is not flashdist's, elastic checkpoints, tensor/pipeline parallel or MoE files
raise :class:`CheckpointError`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..optim.layout import check_master_weight_bits
from ..quant import rho as R
from .errors import CheckpointError
from ..quant.moment import QuantizedMoment
from .deepspeed_files import (HINT, ZERO12_MODEL_FILE, OptimizerFile, load_file, missing, model_states_file,
                              optimizer_files, parse_optimizer_file, stage3_model_files, tag_folder)
from .files import structure_only
from .state import FORMAT_VERSION

Progress = Callable[[str, int, int], None]


def _quiet(_what: str, _done: int, _total: int) -> None:
    pass


# ----- reassembling partitions ------------------------------------------------------------------------


def _merge_zero12(partitions: list[list[torch.Tensor]], shapes: list[dict], paddings, world: int,
                  folder: Path) -> dict[str, torch.Tensor]:
    """``partitions[rank][group]`` flat tensors -> {name: full tensor}, as zero_to_fp32 merges ZeRO 1/2."""
    out = {}
    for g, group_shapes in enumerate(shapes):
        full = torch.cat([partitions[r][g].reshape(-1) for r in range(world)])
        offset = 0
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(group_shapes):
            raise CheckpointError(f"flashdist: {folder}: param group {g} has {len(group_shapes)} parameters and "
                                  f"{len(pads)} alignment paddings")
        for i, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            if offset + numel > full.numel():
                raise CheckpointError(f"flashdist: {folder}: param group {g} holds {full.numel()} values, fewer than "
                                      f"its parameters need (at {name}); are the files of one checkpoint?")
            out[name] = full.narrow(0, offset, numel).reshape(shape).clone()  # not a view of the whole group
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 * world (zero_to_fp32's check)
        if math.ceil(offset / align) != math.ceil(full.numel() / align):
            raise CheckpointError(f"flashdist: {folder}: param group {g} holds {full.numel()} values, its "
                                  f"parameters use {offset}; are the files of one checkpoint?")
    return out


def _merge_zero3(partitions: list[list[torch.Tensor]], shapes: list[dict], world: int,
                 folder: Path) -> dict[str, torch.Tensor]:
    """``partitions[rank][sub_group]`` -> {name: full tensor}: each rank holds ceil(numel / world) values of
    every parameter, in order (zero_to_fp32's ZeRO-3 merge)."""
    flat = [torch.cat([t.reshape(-1) for t in partitions[r]]) for r in range(world)]
    out = {}
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > flat[0].numel():
                raise CheckpointError(f"flashdist: {folder}: the partitions hold fewer values than the parameters "
                                      f"need (at {name}); are the files of one checkpoint?")
            pieces = torch.cat([flat[r].narrow(0, offset, part) for r in range(world)])
            out[name] = (pieces if pieces.numel() == numel else pieces[:numel].clone()).reshape(shape)
            offset += part
    if offset != flat[0].numel():
        raise CheckpointError(f"flashdist: {folder}: the partitions hold {flat[0].numel()} values per rank, the "
                              f"parameters use {offset}; are the files of one checkpoint?")
    return out


# ----- one rank's optimizer file ----------------------------------------------------------------------


def _rank_partitions(file: OptimizerFile, stage: int) -> tuple[list[dict], list[dict], list[int]]:
    """([{"theta": fp32, moment: fp32, "step": float} per partition], param groups, group of each partition)."""
    path = file.path
    if file.stage != stage:
        raise CheckpointError(f"flashdist: {path} has ZeRO stage {file.stage}, rank 0 has {stage}: "
                              "files of two checkpoints in one folder?")
    groups = file.state["param_groups"]
    if not groups or any("flashdist_format" not in g for g in groups):
        raise CheckpointError(f"flashdist: {path} was saved by another optimizer (its param groups have no "
                              "flashdist_format). " + HINT + "; for other optimizers use DeepSpeed's zero_to_fp32 "
                              "and flashdist.load_fp32_state_dict")
    parts, owner = [], []
    for k, (g, entry, master) in enumerate(file.partitions()):
        owner.append(g)
        n = master.numel()
        if not entry:
            raise CheckpointError(f"flashdist: {path} has no optimizer state for master partition {k} (saved before "
                                  "the first optimizer step?); there are no moments to convert. Start from the "
                                  "weights instead: DeepSpeed's zero_to_fp32 and flashdist.load_fp32_state_dict")
        group = groups[g]
        rho = entry.get("rho")
        theta = master.reshape(-1).float()
        if rho is not None:
            theta = R.merge(master.reshape(-1), rho.reshape(-1)[:n])
        part: dict[str, Any] = {"theta": theta, "step": float(entry.get("step", 0))}
        for key, value in entry.items():
            name, piece = QuantizedMoment.split_key(key)
            if key in ("step", "rho") or piece == "scales" or not isinstance(value, torch.Tensor):
                continue
            if piece == "codes":
                if QuantizedMoment.scales_key(name) not in entry:
                    raise CheckpointError(f"flashdist: {path}: partition {k} has {key} without "
                                          f"{QuantizedMoment.scales_key(name)}")
                # DeepSpeed partitions are flat: one row of groups in storage order, whatever the codes' shape
                value = QuantizedMoment.from_state(entry, name, flat=True,
                                                   companded=group.get("companded", True)).dequantize()
            else:
                if not value.is_floating_point():
                    raise CheckpointError(f"flashdist: {path}: state {key!r} of partition {k} is {value.dtype}, "
                                          "expected a float moment")
            if value.numel() < n:
                raise CheckpointError(f"flashdist: {path}: state {name!r} of partition {k} has {value.numel()} "
                                      f"values, the master partition {n}")
            part[name] = value.reshape(-1)[:n].float()
        parts.append(part)
    return parts, groups, owner


# ----- the whole checkpoint ---------------------------------------------------------------------------


def read_deepspeed(path: str | os.PathLike, tag: str | None = None, *, master_weight_bits: int | None = None,
                   progress: Progress = _quiet, structure: bool = False) -> dict:
    """A DeepSpeed ZeRO 1/2/3 checkpoint of a flashdist optimizer as the nested checkpoint dict of
    :func:`flashdist.checkpoint.save` (full CPU tensors, portable optimizer state keyed by FQN).

    ``path``: the folder given to ``engine.save_checkpoint`` (``tag`` defaults to its ``latest``), or a tag
    folder itself. ``master_weight_bits``: 24 (int8 rho) or 32 (int16 rho) for the output; default: the
    checkpoint's setting. Model parameters keep the dtype DeepSpeed's model has (bf16 under ``"bf16"``) and
    carry the master weight as parameter + rho. Raises :class:`CheckpointError` (a ``ValueError``) naming
    the file and what to do for incomplete or unsupported checkpoints.

    ``structure``: the same dict with meta tensors (their shapes and dtypes) and the real step counts, reading
    no tensor data (:func:`~flashdist.checkpoint.files.structure_only` of each mapped file, the reassembly run
    on meta tensors): memory independent of the partitions' sizes, for ``inspect``. Default: every tensor
    read, memory about twice the checkpoint's optimizer state."""
    folder = tag_folder(path, tag)
    load = (lambda p: structure_only(load_file(p))) if structure else load_file
    files, prefix = optimizer_files(folder)
    # ---- model states: world size, stage, parameter names and shapes
    model_path = model_states_file(folder)
    zero12_model = folder / ZERO12_MODEL_FILE
    stage3_models = stage3_model_files(folder)
    progress("reading deepspeed", 0, 1)
    model_sd = load(model_path)
    world = model_sd.get("dp_world_size")
    shapes = model_sd.get("param_shapes")
    shapes = [shapes] if isinstance(shapes, dict) else shapes  # older DeepSpeed: one dict for all groups
    if not isinstance(world, int) or world < 1 or not isinstance(shapes, list):
        raise CheckpointError(f"flashdist: {model_path} is not a DeepSpeed model-states file (no dp_world_size / "
                              "param_shapes). " + HINT)
    stage_hint = (model_sd.get("ds_config") or {}).get("zero_optimization", {}) or {}
    for r in range(world):
        if r not in files:
            raise missing(folder, "optimizer state", f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", r, world)
    extra_ranks = sorted(set(files) - set(range(world)))
    if extra_ranks:
        raise CheckpointError(f"flashdist: {folder} has optimizer files of ranks {extra_ranks}, but the checkpoint "
                              f"was saved on {world} ranks: files of two checkpoints in one folder?")
    if not zero12_model.is_file():
        for r in range(world):
            if r not in stage3_models:
                raise missing(folder, "ZeRO-3 model states", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", r, world)
    # ---- every rank's partitions
    total = world + 2
    progress("reading deepspeed", 1, total)
    first = parse_optimizer_file(load(files[0]), files[0])
    stage = first.stage
    if stage_hint.get("stage") not in (None, stage) and isinstance(stage_hint.get("stage"), int):
        raise CheckpointError(f"flashdist: {files[0]} has ZeRO stage {stage}, {model_path} says "
                              f"{stage_hint.get('stage')}: files of two checkpoints in one folder?")
    if stage != 3 and not zero12_model.is_file():
        raise CheckpointError(f"flashdist: {folder} lacks mp_rank_00_model_states.pt (the ZeRO-{stage} model states)")
    count = first.partition_count
    counts = set(count) if isinstance(count, list) else {count}
    if counts != {world}:
        raise CheckpointError(f"flashdist: {files[0]} was saved with {sorted(counts, key=str)} partitions, the model "
                              f"states with {world} ranks: files of two checkpoints in one folder?")
    paddings = first.paddings
    per_rank = []
    groups = owner = None
    for r in range(world):
        file = first if r == 0 else parse_optimizer_file(load(files[r]), files[r])
        parts, rank_groups, rank_owner = _rank_partitions(file, stage)
        if groups is None:
            groups, owner = rank_groups, rank_owner
        elif len(rank_owner) != len(owner):
            raise CheckpointError(f"flashdist: {files[r]} has {len(rank_owner)} master partitions, rank 0 has "
                                  f"{len(owner)}: files of two checkpoints in one folder?")
        per_rank.append(parts)
        first = file = None
        progress("reading deepspeed", r + 2, total)
    del first
    if len(shapes) != len(groups):
        raise CheckpointError(f"flashdist: {model_path} has {len(shapes)} parameter groups, the optimizer "
                              f"{len(groups)}: files of two checkpoints in one folder?")
    keys = {k for part in per_rank[0] for k in part} - {"step"}
    for r, parts in enumerate(per_rank):
        for k, part in enumerate(parts):
            if set(part) - {"step"} != keys:
                raise CheckpointError(f"flashdist: {files[r]}: partition {k} has state {sorted(part)}, rank 0's "
                                      f"partitions have {sorted(keys | {'step'})}")

    steps = _steps_by_parameter(per_rank, shapes, stage, world, folder)

    def merged(key: str) -> dict[str, torch.Tensor]:
        partitions = [[p.pop(key) for p in parts] for parts in per_rank]  # freed once merged
        if stage == 3:
            return _merge_zero3(partitions, shapes, world, folder)
        return _merge_zero12(partitions, shapes, paddings, world, folder)

    theta = merged("theta")
    moments = {key: merged(key) for key in sorted(keys - {"theta"})}
    progress("reading deepspeed", total, total)

    # ---- model entries: parameters (split into the model dtype + rho), frozen parameters, buffers
    module = model_sd.get("module") or {}
    buffers = set(model_sd.get("buffer_names") or [])
    bits = master_weight_bits
    if bits is None:
        found = {g.get("master_weight_bits") for g in groups}
        bits = found.pop() if len(found) == 1 else 24
    check_master_weight_bits(bits, error=CheckpointError)
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict] = {}
    names = [name for group_shapes in shapes for name in group_shapes]
    for i, name in enumerate(names):
        progress("parameters", i, len(names))
        saved = module.get(name)
        dtype = saved.dtype if isinstance(saved, torch.Tensor) else torch.bfloat16
        value = theta.pop(name)
        entry: dict[str, torch.Tensor] = {"step": torch.tensor(steps[name], dtype=torch.float32)}
        for key, values in moments.items():
            entry[key] = values.pop(name)
        if R.splits(dtype, bits):
            param, entry["rho"] = R.split(value, dtype, R.rho_dtype(bits))
        else:
            param = value.to(dtype)
        model[name] = param
        state[name] = entry
    progress("parameters", len(names), len(names))
    model.update(_frozen(model_sd, stage, world, folder, stage3_models, load))
    for name in module:
        if name in buffers:
            model[name] = module[name].clone()
    for alias, source in (model_sd.get("shared_params") or {}).items():
        if source in model and alias not in model:
            model[alias] = model[source]
    param_groups = []
    for group, group_shapes in zip(groups, shapes):
        out = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        out.update(params=list(group_shapes), flat_layout=False, master_weight_bits=bits, flashdist_format="portable",
                   flashdist_version=FORMAT_VERSION)
        param_groups.append(out)
    return {"model": model, "optim": {"state": state, "param_groups": param_groups},
            "extra": {"step": int(model_sd.get("global_steps", 0))}}


def _steps_by_parameter(per_rank: list[list[dict]], shapes: list[dict], stage: int, world: int,
                        folder: Path) -> dict[str, float]:
    """The step count of each parameter: that of the partition (ZeRO 1/2: the group; ZeRO 3: the sub-group) it
    lies in, which every rank must agree on."""
    steps = []
    for k in range(len(per_rank[0])):
        values = {parts[k]["step"] for parts in per_rank}
        if len(values) != 1:
            raise CheckpointError(f"flashdist: {folder}: master partition {k} was stepped {sorted(values)} times on "
                                  "different ranks; the files do not belong to one checkpoint")
        steps.append(values.pop())
    out = {}
    if stage != 3:  # one partition per param group and rank
        for g, group_shapes in enumerate(shapes):
            out.update(dict.fromkeys(group_shapes, steps[g]))
        return out
    bounds = [0]
    for part in per_rank[0]:
        bounds.append(bounds[-1] + part["theta"].numel())
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            size = math.ceil(math.prod(shape) / world)
            end = offset + max(size, 1)
            spanned = {steps[k] for k in range(len(steps)) if bounds[k] < end and offset < bounds[k + 1]}
            if len(spanned) > 1:
                raise CheckpointError(f"flashdist: {folder}: the sub-groups holding {name} were stepped "
                                      f"{sorted(spanned)} times")
            out[name] = spanned.pop() if spanned else steps[-1]
            offset += size
    return out


def _frozen(model_sd: dict, stage: int, world: int, folder: Path, stage3_models: dict,
            load: Callable[[Path], dict] = load_file) -> dict[str, torch.Tensor]:
    """Parameters without gradients (no optimizer state): whole in ZeRO 1/2's module, in fragments in ZeRO 3."""
    shapes = model_sd.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if stage != 3:
        module = model_sd.get("module") or {}
        return {name: module[name].clone() for name in shapes if name in module}
    fragments = [load(stage3_models[r]).get("frozen_param_fragments") or {} for r in range(world)]
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if any(name not in f for f in fragments):
            raise CheckpointError(f"flashdist: {folder}: a ZeRO-3 model-states file lacks the fragment of the frozen "
                                  f"parameter {name}")
        out[name] = torch.cat([f[name].reshape(-1) for f in fragments])[:numel].reshape(shape).clone()
    return out


def describe(path: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
    """What a DeepSpeed checkpoint folder is, from its model-states file only: tag folder, ZeRO stage, world size,
    DeepSpeed version, global step."""
    folder = tag_folder(path, tag)
    sd = load_file(model_states_file(folder))
    config = sd.get("ds_config") or {}
    bf16 = config.get("bf16") or config.get("bfloat16") or {}
    return {"folder": str(folder), "zero_stage": (config.get("zero_optimization") or {}).get("stage"),
            "world_size": sd.get("dp_world_size"), "ds_version": sd.get("ds_version"),
            "global_steps": sd.get("global_steps"),
            "masters": "bf16" if bf16.get("bf16_master_weights_and_grads") else "fp32"}
