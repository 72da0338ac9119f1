"""Checkpoint files without a model: inspect, convert between DCP / torch / safetensors, switch the
optimizer-state format, export fp32 master weights. The ``flashdist`` command is a thin layer over these.

A checkpoint here is the nested dict that :func:`flashdist.checkpoint.save` writes; every kind of file it may
be in (DCP, torch, safetensors, DeepSpeed ZeRO, flashoptim) is read by :mod:`flashdist.checkpoint.sources`.

Every write goes to a temporary path that is renamed into place once complete, and refuses to replace an
existing path unless asked to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..quant import rho as R
from ..quant.moment import MomentLayout, QuantizedMoment

from .dcp_files import SafeFileSystemReader
from .errors import CheckpointError
from .files import printable, reason, shown
from .names import TIED, is_ties, owners
from .output import Fetch, Spec, atomic_output, check_destination, write_dcp, write_safetensors, write_torch
from .publish import resolve
from .sources import (KINDS, Fetcher, MemorySource, Progress, Source, dcp_entries, detect, json_header, open_source,
                      quiet, read, read_dcp, titan_routes, value_at)
from .state import FORMAT_VERSION, FORMATS

# this module's public names, with the readers that moved to sources (their old import path)
__all__ = ["EXPORT_DTYPES", "KINDS", "OUTPUTS", "Progress", "Source", "convert", "dcp_entries", "detect", "export",
           "inspect", "master_weights", "open_source", "optimizer_format", "read", "read_dcp", "reformat",
           "saved_world_size", "write"]

OUTPUTS = ("dcp", "torch", "safetensors")


# ----- writing ----------------------------------------------------------------------------------------------


def _write(kind: str, dst: Path, rest, specs: dict[tuple, Spec], fetch: Fetch, progress: Progress) -> None:
    with atomic_output(dst, directory=kind == "dcp") as tmp:
        if kind == "dcp":
            write_dcp(tmp, rest, specs, fetch)
        elif kind == "torch":
            write_torch(tmp, rest, specs, fetch, progress)
        else:
            names = {".".join(map(str, route)): route for route in specs}
            meta = {"flashdist": json_header(rest, dst)}
            meta.update({f"route:{name}": json.dumps(list(route)) for name, route in names.items()})
            write_safetensors(tmp, {n: specs[r] for n, r in names.items()}, lambda n: fetch(names[n]), meta,
                              progress)


def write(state: dict, dst: str | os.PathLike, to: str, *, force: bool = False) -> Path:
    """Write a nested checkpoint dict as ``to`` (dcp, torch or safetensors), atomically."""
    if to not in OUTPUTS:
        raise CheckpointError(f"flashdist: unknown output format {to!r}; expected dcp, torch or safetensors")
    dst = Path(dst)
    check_destination([], dst, to, force)
    source = MemorySource(state)
    _write(to, dst, source.rest, source.specs, Fetcher(source), quiet)
    return dst


# ----- optimizer-state format -------------------------------------------------------------------------------


def _groups_by_param(optim: dict) -> dict[str, dict]:
    out = {}
    for group in optim.get("param_groups", []):
        for name in group.get("params", []):
            out[name] = group
    return out


def optimizer_format(optim: dict) -> str | None:
    groups = optim.get("param_groups") or []
    formats = {g.get("flashdist_format") for g in groups}
    if len(formats) == 1:
        return formats.pop()
    return None


def reformat(optim: dict, fmt: str, progress: Progress = quiet) -> dict:
    """The optimizer state dict (full tensors, keyed by FQN) in format ``fmt``: compressed -> portable
    dequantizes, portable -> compressed quantizes with the row-aligned layout (so the result loads into
    FSDP2 at any world size, exactly)."""
    _check_format(fmt)
    groups = _groups_by_param(optim)
    state = optim.get("state", {})
    out_state = {}
    for i, (name, entry) in enumerate(state.items()):
        progress("optimizer state", i, len(state))
        out_state[name] = _reformat_entry(entry, groups.get(name, {}), fmt, name)
    progress("optimizer state", len(state), len(state))
    return {"state": out_state, "param_groups": _reformat_groups(optim.get("param_groups", []), fmt)}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise CheckpointError(f"flashdist: unknown optimizer-state format {fmt!r}; expected one of {FORMATS}")


def _reformat_groups(groups: list, fmt: str) -> list:
    return [dict(g, flashdist_format=fmt, flashdist_version=FORMAT_VERSION) for g in groups]


def _reformat_entry(entry: dict, group: dict, fmt: str, param="?") -> dict:
    """One parameter's optimizer state (of ``param``, named in errors) in format ``fmt``. Works on meta tensors
    too (the output's shapes)."""
    companded, flat = group.get("companded", True), group.get("flat_layout", False)
    entry = dict(entry)
    moments = sorted({name for name, part in map(QuantizedMoment.split_key, entry) if part == "codes"} |
                     {k for k in entry if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")})
    for m in moments:
        if fmt == "portable" and QuantizedMoment.held_in(entry, m):
            _check_codes(entry, m, flat is True, param)
            moment = QuantizedMoment.from_state(entry, m, flat=flat, companded=companded, pop=True)
            pieces = _pieces(moment.codes, moment.layout)
            if len(pieces) == 1:
                entry[m] = moment.dequantize()
                continue
            values = torch.empty(moment.codes.shape, dtype=torch.float32, device=moment.codes.device)
            for part in pieces:
                values[part] = moment.row_slice(part).dequantize()
            entry[m] = values
        elif fmt == "compressed" and isinstance(entry.get(m), torch.Tensor) and entry[m].is_floating_point():
            values = entry[m]
            layout = MomentLayout.of(tuple(values.shape), flat) if group.get("quantize_states", True) else None
            if layout is None:
                continue
            pieces = [QuantizedMoment.quantize(m, values[part].float(), layout, companded)
                      for part in _pieces(values, layout)]
            del entry[m]
            QuantizedMoment.cat(pieces).store(entry)
    return entry


def _check_codes(entry: dict, m: str, flat: bool, param) -> None:
    """Refuse (one line naming the parameter) codes and scales that flashdist does not write: codes of another
    dtype, scales of another dtype or shape than the codes' layout gives, scales that are not finite and
    non-negative (a damaged or crafted checkpoint: they dequantized to NaN, or were broadcast, without a word)."""
    codes_key, scales_key = QuantizedMoment.keys(m)
    codes, scales = entry.get(codes_key), entry.get(scales_key)
    where = f"flashdist: optimizer state {str(param)[:80]!r}"
    if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise CheckpointError(f"{where} has '{codes_key}' without its tensor pair '{scales_key}'")
    layout = MomentLayout.of(tuple(codes.shape), flat)
    want = (layout.rows, layout.groups_per_row) if layout is not None else None
    if codes.dtype != QuantizedMoment.code_dtype(m) or scales.dtype != torch.bfloat16 or tuple(scales.shape) != want:
        raise CheckpointError(f"{where}: '{codes_key}' {str(codes.dtype).removeprefix('torch.')} "
                              f"{tuple(codes.shape)} with '{scales_key}' {str(scales.dtype).removeprefix('torch.')} "
                              f"{tuple(scales.shape)} are not codes and scales flashdist writes (expected "
                              f"{str(QuantizedMoment.code_dtype(m)).removeprefix('torch.')} codes with bfloat16 "
                              f"scales of shape {want}); the checkpoint is damaged or crafted")
    if scales.device.type != "meta" and not bool(torch.all(torch.isfinite(scales) & (scales >= 0))):
        raise CheckpointError(f"{where}: '{scales_key}' holds values that are not finite and non-negative; the "
                              "checkpoint is damaged or crafted")


_VALUES_PER_PIECE = 2**20  # a large moment is (de)quantized in pieces of whole rows: the float temporaries stay small


def _pieces(t: torch.Tensor, layout: MomentLayout) -> list[slice]:
    """Slices of whole rows of a row-aligned moment (groups never cross rows, so each piece quantizes as it
    does in the whole tensor); one slice, the whole, for a single row (the flat layout) or a small tensor."""
    if layout.rows <= 1 or t.dim() == 0 or t.numel() <= _VALUES_PER_PIECE:
        return [slice(None)]
    step = max(1, _VALUES_PER_PIECE // max(layout.cols, 1))
    return [slice(i, i + step) for i in range(0, len(t), step)]


def _reformat_plan(source: Source, fmt: str):
    """``source``'s rest and specs with its optimizer state in format ``fmt``, the routes that change, and the
    function that computes one parameter's new state (read from ``source``)."""
    _check_format(fmt)
    rest, specs = source.rest, source.specs
    optim = rest.get("optim") if isinstance(rest, dict) else None
    if not isinstance(optim, dict) or not isinstance(optim.get("state"), dict):
        return rest, specs, {}, None
    groups = _groups_by_param(optim)
    inputs: dict[Any, dict[str, tuple]] = {}
    for route in specs:
        if len(route) == 4 and route[:2] == ("optim", "state"):
            inputs.setdefault(route[2], {})[route[3]] = route
    out_specs: dict[tuple, Spec] = {}
    derived: dict[tuple, Any] = {}
    new_state = {}
    for route, spec in specs.items():
        name = route[2] if len(route) == 4 and route[:2] == ("optim", "state") else None
        if name is None:
            out_specs[route] = spec
            continue
        if name in new_state:
            continue
        meta = {k: torch.empty(specs[r][0], dtype=specs[r][1], device="meta") for k, r in inputs[name].items()}
        new_state[name] = {k: v for k, v in optim["state"][name].items() if k not in inputs[name]}
        for k, t in _reformat_entry(meta, groups.get(name, {}), fmt, name).items():
            new_state[name][k] = None
            out_specs[("optim", "state", name, k)] = (tuple(t.shape), t.dtype)
            if k not in inputs[name] or specs[inputs[name][k]] != out_specs[("optim", "state", name, k)]:
                # made from one moment (its values, or its codes and scales); the rest is read as it is
                derived[("optim", "state", name, k)] = (name, QuantizedMoment.split_key(k)[0])
    new_state.update({n: e for n, e in optim["state"].items() if n not in new_state})
    rest = dict(rest, optim=dict(optim, state=new_state,
                                 param_groups=_reformat_groups(optim.get("param_groups", []), fmt)))

    def compute(what) -> dict[tuple, torch.Tensor]:
        name, moment = what
        routes = {k: r for k, r in inputs[name].items() if QuantizedMoment.split_key(k)[0] == moment}
        got = source.get(list(routes.values()))
        entry = _reformat_entry({k: got[r] for k, r in routes.items()}, groups.get(name, {}), fmt, name)
        return {("optim", "state", name, k): v for k, v in entry.items()}

    return rest, out_specs, derived, compute


# ----- inspect ----------------------------------------------------------------------------------------------


def _size_on_disk(path: Path) -> int:
    """Bytes of the regular files in ``path`` (links not followed: a link out of the folder is not its size)."""
    if path.is_dir():
        return sum(st.st_size for f in path.rglob("*") if stat.S_ISREG((st := f.lstat()).st_mode))
    return path.stat().st_size


def saved_world_size(path: str | os.PathLike, *, metadata=None) -> int:
    """How many ranks wrote DCP checkpoint ``path``, from the files its .metadata names (``__<rank>_<n>.distcp``);
    other files in the folder do not count. ``metadata``: the checkpoint's, when the caller has read it."""
    md = metadata if metadata is not None else SafeFileSystemReader(str(resolve(path))).read_metadata()
    files = {str(info.relative_path) for info in (md.storage_data or {}).values()}
    ranks = {m.group(1) for f in files if (m := re.match(r"^__(\d+)_\d+\.distcp$", f))}
    return len(ranks) or len(files)


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint is, without loading its tensors where the format allows (DCP: metadata plus the
    few small plain-data entries; safetensors: the header; torch, DeepSpeed and flashoptim files: their
    pickles, tensors mapped and never read but a step count, DeepSpeed's partitions reassembled as meta
    tensors; an FSDP folder: its two DCP folders' metadata), within
    :func:`~flashdist.checkpoint.files.metadata_budget`. A checkpoint whose parts do not have the types
    flashdist writes (a damaged or crafted one) raises :class:`CheckpointError` naming it."""
    with _as_checkpoint_error(path):
        return _inspect(Path(path))


def _inspect(path: Path) -> dict[str, Any]:
    kind = detect(path)
    info: dict[str, Any] = {"path": str(path), "kind": kind}
    titan = False
    if kind == "dcp":
        where = resolve(path)
        metadata = SafeFileSystemReader(str(where)).read_metadata()  # once: checking it costs a pass over it
        checked: set = set()
        entries = dcp_entries(where, metadata)
        titan = titan_routes(entries) is not None  # torchtitan's layout: read as the other sources below
    if kind == "dcp" and not titan:
        small = [k for k, (route, size, _) in entries.items()
                 if size is None and route[:2] == ("optim", "param_groups")]
        groups = (read_dcp(where, small, metadata=metadata, checked=checked).get("optim", {}).get("param_groups", [])
                  if small else [])
        tensors = {k: v for k, v in entries.items() if v[1] is not None}
        model = {k: v for k, v in tensors.items() if v[0][0] == "model"}
        optim = {k: v for k, v in tensors.items() if v[0][0] == "optim"}
        info["saved_world_size"] = saved_world_size(where, metadata=metadata)
        info["path"] = str(where)
    else:
        source = open_source(path, structure=True)  # the structure; no tensor read but a step count
        if kind == "deepspeed":
            from .deepspeed_import import describe

            ds = describe(path)
            info.update(path=ds["folder"], zero_stage=ds["zero_stage"], deepspeed_masters=ds["masters"],
                        deepspeed_version=ds["ds_version"])
        optim_rest = source.rest.get("optim", {}) if isinstance(source.rest, dict) else {}
        groups = optim_rest.get("param_groups", []) if isinstance(optim_rest, dict) else []
        tensors = {".".join(map(str, r)): (r, shape, dtype) for r, (shape, dtype) in source.specs.items()}
        model = {k: v for k, v in tensors.items() if v[0][0] == "model"}
        optim = {k: v for k, v in tensors.items() if v[0][0] == "optim"}
        info["saved_world_size"] = (ds["world_size"] if kind == "deepspeed" else
                                    saved_world_size(where, metadata=metadata) if titan else None)  # a file: full
        if titan:
            info.update(path=str(where), layout="torchtitan")
        elif kind == "trainer" and source.optimizer.name == "optimizer.bin":
            info["layout"] = "Accelerate save_state"
        elif kind == "fsdp-folder":
            from .trainer_files import FSDP_OPTIMIZER

            info.update(layout="Trainer / Accelerate under FSDP (sharded)",
                        saved_world_size=saved_world_size(Path(path) / FSDP_OPTIMIZER))
    if not model and not optim:  # nothing flashdist reads: say so, never "0 parameters"
        tops = sorted({str(r[0]) for r, _, _ in tensors.values()} | (
            set(map(str, source.rest)) if kind != "dcp" and isinstance(source.rest, dict) else set()))
        raise CheckpointError(
            f"flashdist: {printable(info['path'])} holds no model weights and no optimizer state under the keys "
            f"flashdist reads ('model', 'optim'; it has: {shown(tops, 120) if tops else 'nothing'}): save it with "
            "flashdist.checkpoint.save, or convert it to that layout first")
    numel = lambda shape: int(torch.Size(shape).numel())  # noqa: E731
    n_params = sum(numel(size) for _, size, _ in model.values())
    dtypes: dict[str, int] = {}
    for _, size, dtype in model.values():
        dtypes[str(dtype).replace("torch.", "")] = dtypes.get(str(dtype).replace("torch.", ""), 0) + numel(size)
    optim_keys = {route[-1] for route, _, _ in optim.values()}
    fmt = ({g.get("flashdist_format") for g in groups} - {None})
    info.update({
        "parameters": n_params,
        "parameter_tensors": len(model),
        "model_dtypes": dtypes,
        "optimizer_format": fmt.pop() if len(fmt) == 1 else ("mixed" if fmt else
                                                             ("compressed" if QuantizedMoment.any_codes(optim_keys)
                                                              else ("portable" if optim_keys else None))),
        "format_version": max((g.get("flashdist_version", 0) for g in groups), default=None),
        "master_weight_bits": sorted({g.get("master_weight_bits") for g in groups}, key=str) if groups else None,
        "optimizer_state_keys": sorted(optim_keys),
        "bytes_on_disk": _size_on_disk(Path(info["path"])),
    })
    steps = [k for k, (route, size, _) in optim.items() if route[-1] == "step" and size == ()]
    if steps:
        first = steps[0]
        if kind == "dcp" and not titan:
            node = value_at(read_dcp(where, [first], metadata=metadata, checked=checked), optim[first][0])
        else:
            node = source.get([optim[first][0]])[optim[first][0]]
        info["step"] = int(float(node))
    info["bytes_per_param"] = info["bytes_on_disk"] / n_params if n_params else None
    if kind == "dcp" and not titan:
        state_specs = {route: (size, dtype) for route, size, dtype in tensors.values()}
        rest, order, unknown = {"optim": {"param_groups": groups}}, None, None
    else:
        state_specs, rest = source.specs, source.rest
        order, unknown = getattr(source, "model_order", None), getattr(source, "order_unknown", None)
    info["masters"] = _masters_line(rest, state_specs, order, unknown, len(model))
    return info


def _masters_line(rest, specs, order, unknown, n_weights: int) -> str:
    """What an export of this checkpoint gives, proved from its structure: which weights get their rho, and
    how the state was named; or why the rho cannot be attached (export refuses then)."""
    try:
        found = owners(rest, specs, order, unknown)
    except CheckpointError as e:
        return f"not attachable, export refuses: {str(e).removeprefix('flashdist: ')}"
    if not found.rho:
        return f"the saved weights (no rho in the optimizer state; {found.how})"
    bits = sorted({R.MASTER_WEIGHT_BITS_OF[dtype] for dtype in found.rho_dtype.values()})
    cast = sorted({str(specs[r][1]).removeprefix("torch.") for r in found.rho.values()} - {"int8", "int16"})
    return (f"param + rho ({'/'.join(map(str, bits))}-bit) for {len(found.rho)} of {n_weights} weights; "
            f"state named by {found.how}" + (f"; rho held as {'/'.join(cast)} (a torch optimizer's cast), read "
                                             "back as whole numbers" if cast else ""))


# ----- convert / export -------------------------------------------------------------------------------------


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, fmt: str | None = None, force: bool = False,
            progress: Progress = quiet, tag: str | None = None, master_weight_bits: int | None = None) -> Path:
    """Read ``src`` (any KIND), optionally switch its optimizer-state format, write ``dst`` as ``to``, one tensor
    at a time (a DeepSpeed folder or a flashoptim file is reassembled in memory first). ``tag`` and
    ``master_weight_bits``: for a DeepSpeed ``src`` (:func:`read`). ``dst`` is checked first
    (:func:`flashdist.checkpoint.output.check_destination`) and written to a temporary name, then renamed:
    a failure leaves nothing behind."""
    if to not in OUTPUTS:
        raise CheckpointError(f"flashdist: unknown output format {to!r}; expected dcp, torch or safetensors")
    dst = Path(dst)
    check_destination([Path(src)], dst, to, force)
    if fmt is not None:
        _check_format(fmt)
    with _as_checkpoint_error(src):
        source = open_source(src, tag=tag, master_weight_bits=master_weight_bits, progress=progress)
        rest, specs, derived, compute = (source.rest, source.specs, {}, None) if fmt is None else \
            _reformat_plan(source, fmt)
        order = [r for r in specs if r not in derived]  # what the writers ask for, in their usual order
        _write(to, dst, rest, specs, Fetcher(source, derived, compute, order=order), progress)
    return dst


@contextlib.contextmanager
def _as_checkpoint_error(src):
    """A checkpoint whose parts do not have the types flashdist writes (param groups that are not dicts, say:
    a damaged or crafted one) raises :class:`CheckpointError` naming ``src``, not the TypeError it meets."""
    try:
        yield
    except CheckpointError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, OverflowError) as e:
        raise CheckpointError(f"flashdist: {src} does not hold what a checkpoint holds ({reason(e)}); it is "
                              "damaged or was not written by flashdist") from None


def _master_plan(source: Source, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Spec], Callable[[str], torch.Tensor]]:
    """The model's weights as master weights in ``dtype`` (parameter + rho where the optimizer state has one),
    keyed by FQN: their specs, and a function that reads one. Each state is attached to its weight by
    :func:`flashdist.checkpoint.names.owners` (state keyed by name, or by index through ``param_names`` or the
    model's order), which refuses a rho it cannot attach. A tied parameter (embedding = LM head) is saved under
    each name but its optimizer state under one: a model entry that no param group lists, without rho, is that
    parameter's alias and gets its master weight where the checkpoint says they are one tensor (the ties
    :func:`flashdist.checkpoint.save` records: a frozen copy of a weight is then exported as itself); else where
    they are one storage (a torch file, a state in memory) or, where nothing tells (another tool's DCP folder,
    safetensors, a state whose tensors were copied to the CPU), where its values are bit-identical."""
    if not any(route[0] == "model" and len(route) == 2 for route in source.specs):
        tops = sorted({str(r[0]) for r in source.specs} | (set(map(str, source.rest)) if isinstance(source.rest, dict)
                                                             else set()))
        raise CheckpointError(f"flashdist: the checkpoint has no model weights under the key flashdist reads ('model'; "
                              f"it has: {shown(tops, 120) if tops else 'nothing'}): save the model and optimizer with "
                              "flashdist.checkpoint.save, or convert it to that layout first")
    found = owners(source.rest, source.specs, getattr(source, "model_order", None),
                   getattr(source, "order_unknown", None))
    model, rho = found.model, found.rho
    listed = set(found.optim_names.values())
    alias: dict[str, str] = {}
    extra = source.rest.get("extra") if isinstance(source.rest, dict) else None
    recorded = extra.get(TIED) if isinstance(extra, dict) else None
    tie_of = {n: i for i, names in enumerate(recorded) for n in names} if is_ties(recorded) else None
    for name, route in model.items():
        if name in rho or name in listed or source.specs[route][1] not in (torch.bfloat16, torch.float16):
            continue
        for other in rho:
            if source.specs[model[other]] != source.specs[route]:
                continue
            one = (tie_of.get(name, -1) == tie_of.get(other)) if tie_of is not None else \
                source.shared(route, model[other])
            if one is None:  # nothing tells: bit-identical values are taken for one tensor
                got = source.get([route, model[other]])
                one = torch.equal(got[route].view(torch.int16), got[model[other]].view(torch.int16))
            if one:
                alias[name] = other
                break
    specs = {}
    for name, route in model.items():
        shape, have = source.specs[route]
        specs[name] = (shape, dtype if have.is_floating_point else have)

    order = []
    for name in specs:
        order += [model[alias.get(name, name)]] + ([rho[alias.get(name, name)]] if alias.get(name, name) in rho else [])
    get = Fetcher(source, order=order)

    def fetch(name: str) -> torch.Tensor:
        owner = alias.get(name, name)
        value = get(model[owner])
        if owner in rho:  # owners() attached it to a bf16/fp16 weight of the same shape
            return _merge(value, _rho(get(rho[owner]), found.rho_dtype[owner], owner), dtype)
        return value.to(dtype) if value.is_floating_point() else value

    return specs, fetch


def _rho(value: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A saved rho as ``dtype`` (``Owners.rho_dtype``): itself, or taken back from a torch optimizer's floating
    cast, where every value is a whole number in range."""
    if value.dtype == dtype:
        return value
    back = R.from_float(value, dtype)
    if back is None:
        raise CheckpointError(f"flashdist: rho of {name!r} is {str(value.dtype).removeprefix('torch.')} with values "
                              f"that no {str(dtype).removeprefix('torch.')} rho has (whole numbers in "
                              f"[{torch.iinfo(dtype).min}, {torch.iinfo(dtype).max}]); the file is damaged or edited")
    return back


def _merge(value: torch.Tensor, rho: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """R.merge in pieces (it is elementwise): its fp32 temporaries stay small whatever the tensor's size."""
    out = torch.empty(value.shape, dtype=dtype)
    flat_out, flat_value, flat_rho = out.view(-1), value.reshape(-1), rho.reshape(-1)
    step = 2**18
    for i in range(0, flat_out.numel(), step):
        flat_out[i:i + step] = R.merge(flat_value[i:i + step], flat_rho[i:i + step])
    return out


def master_weights(state: dict, progress: Progress = quiet) -> dict[str, torch.Tensor]:
    """fp32 master weights (parameter + rho where the optimizer state has one), keyed by FQN; a tied
    parameter under each of its names (see :func:`export`)."""
    specs, fetch = _master_plan(MemorySource(state))
    out = {}
    for i, name in enumerate(specs):
        progress("export", i, len(specs))
        out[name] = fetch(name)
    progress("export", len(specs), len(specs))
    return out


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False, progress: Progress = quiet,
           hf: bool = False, dtype: str = "fp32", config: str | os.PathLike | None = None,
           max_shard_size: int | str = "5GB") -> Path:
    """The master weights of checkpoint ``src`` (parameter + rho; a tied parameter under each of its names, each
    the master weight), keyed by the model's FQNs, in ``dtype`` (fp32: the masters; bf16: rounded to nearest),
    one tensor at a time. ``hf=False``: one safetensors file ``dst``. ``hf=True``: a Hugging Face model folder
    ``dst`` (``model.safetensors``, or shards of at most ``max_shard_size`` with
    ``model.safetensors.index.json``; ``config`` copied to ``config.json``) that ``from_pretrained`` loads."""
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"flashdist: unknown export dtype {dtype!r}; expected one of {tuple(EXPORT_DTYPES)}")
    if config is not None and not hf:
        raise CheckpointError("flashdist: a config goes with a Hugging Face folder export (--hf)")
    dst = Path(dst)
    check_destination([Path(src)], dst, "hf" if hf else "safetensors", force)
    # a DeepSpeed folder's fp32 master partitions (a flashoptim file's ECC masters) survive all 32 bits in an
    # int16 rho (24 bits would round them)
    with _as_checkpoint_error(src):
        source = open_source(src, master_weight_bits=32 if detect(src) in ("deepspeed", "flashoptim") else None,
                             progress=progress)
        specs, fetch = _master_plan(source, EXPORT_DTYPES[dtype])
        if hf:
            from .hf import write_hf_folder

            write_hf_folder(dst, specs, fetch, config=config, max_shard_size=max_shard_size, progress=progress)
        else:
            with atomic_output(dst, directory=False) as tmp:
                write_safetensors(tmp, specs, fetch, {"format": "pt"}, progress)
    return dst
