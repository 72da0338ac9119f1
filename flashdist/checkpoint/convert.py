"""Checkpoint files without a model: inspect, convert between DCP / torch / safetensors, switch the
optimizer-state format, export fp32 master weights. The ``flashdist`` command is a thin layer over these.

A checkpoint here is the nested dict that :func:`flashdist.checkpoint.save` writes:
``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}, "extra": {...}}``.

- DCP directory: read through the safe reader (no code-running pickles), one tensor at a time where the
  operation allows (inspect reads metadata only).
- torch file: ``torch.save`` of that dict; read with ``weights_only=True``.
- safetensors file: tensors under flat keys (``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``extra.<key>``);
  everything else (param groups, plain extras) as JSON in the header metadata under ``flashdist``.
- DeepSpeed ZeRO 1/2/3 folder (``engine.save_checkpoint`` with a flashdist optimizer): read only, through
  :func:`flashdist.checkpoint.deepspeed_import.read_deepspeed` (every rank's partitions reassembled per
  parameter; portable optimizer state; parameter + rho).
- flashoptim torch file (``{"model": ..., "optimizer": ...}`` of the FlashOptim paper's library): read only,
  through :func:`flashdist.checkpoint.flashoptim_import.read_flashoptim`.

Every write goes to a temporary path that is renamed into place once complete, and refuses to replace an
existing path unless asked to.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..quant import rho as R
from torch.distributed.checkpoint.api import CheckpointException

from .dcp import CheckpointError, SafeFileSystemReader, SafeLoadPlanner, _short, resolve
from .state import FORMAT_VERSION, FORMATS, dequantize_moment, quantize_moment

KINDS = ("dcp", "torch", "safetensors", "deepspeed", "flashoptim")
Progress = Callable[[str, int, int], None]


def _quiet(_what: str, _done: int, _total: int) -> None:
    pass


def detect(path: str | os.PathLike) -> str:
    """What ``path`` is: one of KINDS. Raises CheckpointError if it is none of them."""
    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").exists():
            return "dcp"
        if ((path / "latest").exists() or any(path.glob("*/mp_rank_*_model_states.pt"))
                or any(path.glob("*/zero_pp_rank_*")) or any(path.glob("*_optim_states.pt"))):
            return "deepspeed"
        raise CheckpointError(f"flashdist: {path} is a directory but neither a DCP checkpoint (.metadata) nor a "
                              "DeepSpeed checkpoint (latest, */mp_rank_*_model_states.pt, *_optim_states.pt)")
    if not path.exists():
        old = path.with_name(path.name + ".old")
        if (old / ".metadata").exists():
            return "dcp"
        raise CheckpointError(f"flashdist: no such file or directory: {path}")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:2] == b"PK":
        from .flashoptim_import import is_flashoptim_file

        return "flashoptim" if is_flashoptim_file(path) else "torch"
    if len(head) == 8:
        n = int.from_bytes(head, "little")
        if 0 < n < 100 * 2**20 and path.stat().st_size >= 8 + n:
            with open(path, "rb") as f:
                f.seek(8)
                if f.read(1) == b"{":
                    return "safetensors"
    raise CheckpointError(f"flashdist: {path} is not a DCP directory, a torch file or a safetensors file")


# ----- reading ----------------------------------------------------------------------------------------------


def _set(root: dict, route: tuple, value) -> None:
    node = root
    for i, part in enumerate(route[:-1]):
        nxt = route[i + 1]
        if isinstance(node, list):
            while len(node) <= part:
                node.append({} if not isinstance(nxt, int) else [])
            node = node[part]
        else:
            node = node.setdefault(part, [] if isinstance(nxt, int) else {})
    last = route[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value


def dcp_entries(path: str | os.PathLike) -> dict[str, tuple]:
    """Flat key -> (route in the nested dict, size or None for plain data, dtype or None), metadata only."""
    md = SafeFileSystemReader(str(resolve(path))).read_metadata()
    routes = md.planner_data or {}
    out = {}
    for key, meta in md.state_dict_metadata.items():
        route = tuple(routes.get(key, key.split(".")))
        if isinstance(meta, BytesStorageMetadata):
            out[key] = (route, None, None)
        else:
            out[key] = (route, tuple(meta.size), meta.properties.dtype)
    return out


def read_dcp(path: str | os.PathLike, keys: list[str] | None = None) -> dict:
    """Load (some flat keys of) a DCP checkpoint into a nested dict of full CPU tensors, in this process."""
    where = resolve(path)
    entries = dcp_entries(where)
    wanted = entries if keys is None else {k: entries[k] for k in keys}
    nested: dict = {}
    for route, size, dtype in wanted.values():
        _set(nested, route, torch.empty(size, dtype=dtype) if size is not None else None)
    try:
        # the top level must be dicts: dcp.load copies it, and plain-data entries land in nested dicts
        dcp.load(nested, storage_reader=SafeFileSystemReader(str(where)), planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps read failures (missing/truncated shard files)
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {_short(e)}") from e
    return nested


def _read_safetensors(path: Path) -> dict:
    from safetensors import safe_open

    nested: dict = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "flashdist" in meta:
            nested = json.loads(meta["flashdist"])
        for key in f.keys():
            route = tuple(json.loads(meta.get(f"route:{key}", "null")) or key.split("."))
            _set(nested, route, f.get_tensor(key))
    return nested


def read(path: str | os.PathLike, *, tag: str | None = None, master_weight_bits: int | None = None,
         progress: Progress = _quiet) -> dict:
    """The whole checkpoint as a nested dict (tensors on the CPU). ``tag`` and ``master_weight_bits`` apply to
    DeepSpeed folders only (see :func:`flashdist.checkpoint.deepspeed_import.read_deepspeed`)."""
    kind = detect(path)
    if (kind != "deepspeed" and tag is not None) or (kind not in ("deepspeed", "flashoptim") and
                                                     master_weight_bits is not None):
        raise CheckpointError(f"flashdist: {path} is a {kind} checkpoint; a tag and master_weight_bits apply to "
                              "DeepSpeed checkpoints only (master_weight_bits: flashoptim files too)")
    if kind == "flashoptim":
        from .flashoptim_import import read_flashoptim

        return read_flashoptim(path, master_weight_bits=master_weight_bits)
    if kind == "dcp":
        return read_dcp(path)
    if kind == "torch":
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
            raise CheckpointError(f"flashdist: could not read {path}: {str(e).splitlines()[0][:300]}") from None
    if kind == "safetensors":
        try:
            return _read_safetensors(Path(path))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"flashdist: could not read {path}: {str(e).splitlines()[0][:300]}") from None
    from .deepspeed_import import read_deepspeed

    return read_deepspeed(path, tag, master_weight_bits=master_weight_bits, progress=progress)


# ----- writing ----------------------------------------------------------------------------------------------


def _prepare(dst: Path, force: bool) -> Path:
    if dst.exists() and not force:
        raise CheckpointError(f"flashdist: {dst} exists; pass --force (force=True) to replace it")
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    dst.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def _commit(tmp: Path, dst: Path) -> None:
    if dst.is_dir():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)


def _flat_tensors(nested, prefix: tuple = ()) -> tuple[dict[tuple, torch.Tensor], Any]:
    """Split a nested checkpoint into {route: tensor} and the same structure with each tensor as None."""
    if isinstance(nested, torch.Tensor):
        return {prefix: nested}, None
    tensors: dict[tuple, torch.Tensor] = {}
    if isinstance(nested, dict):
        rest = {}
        for k, v in nested.items():
            t, rest[k] = _flat_tensors(v, prefix + (k,))
            tensors.update(t)
        return tensors, rest
    if isinstance(nested, (list, tuple)):
        rest = []
        for i, v in enumerate(nested):
            t, r = _flat_tensors(v, prefix + (i,))
            tensors.update(t)
            rest.append(r)
        return tensors, rest
    return tensors, nested


def write(state: dict, dst: str | os.PathLike, to: str, *, force: bool = False) -> Path:
    """Write a nested checkpoint dict as ``to`` (dcp, torch or safetensors), atomically."""
    dst = Path(dst)
    tmp = _prepare(dst, force)
    if to == "dcp":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    elif to == "torch":
        torch.save(state, tmp)
    elif to == "safetensors":
        from safetensors.torch import save_file

        tensors, rest = _flat_tensors(state)
        flat = {".".join(map(str, route)): t.contiguous() for route, t in tensors.items()}
        meta = {"flashdist": json.dumps(rest)}
        for route in tensors:
            meta[f"route:{'.'.join(map(str, route))}"] = json.dumps(list(route))
        save_file(flat, str(tmp), metadata=meta)
    else:
        raise CheckpointError(f"flashdist: unknown output format {to!r}; expected dcp, torch or safetensors")
    _commit(tmp, dst)
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


def reformat(optim: dict, fmt: str, progress: Progress = _quiet) -> dict:
    """The optimizer state dict (full tensors, keyed by FQN) in format ``fmt``: compressed -> portable
    dequantizes, portable -> compressed quantizes with the row-aligned layout (so the result loads into
    FSDP2 at any world size, exactly)."""
    from ..optim.base import state_layout

    if fmt not in FORMATS:
        raise CheckpointError(f"flashdist: unknown optimizer-state format {fmt!r}; expected one of {FORMATS}")
    groups = _groups_by_param(optim)
    state = optim.get("state", {})
    out_state = {}
    for i, (name, entry) in enumerate(state.items()):
        progress("optimizer state", i, len(state))
        group = groups.get(name, {})
        companded = group.get("companded", True)
        entry = dict(entry)
        moments = sorted({k[: -len("_codes")] for k in entry if k.endswith("_codes")} |
                         {k for k in entry if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")})
        for m in moments:
            if fmt == "portable" and f"{m}_codes" in entry:
                codes, scales = entry.pop(f"{m}_codes"), entry.pop(f"{m}_scales")
                layout = state_layout(tuple(codes.shape), group.get("flat_layout", False))
                entry[m] = dequantize_moment(m, codes, scales, layout[1], companded)
            elif fmt == "compressed" and isinstance(entry.get(m), torch.Tensor) and entry[m].is_floating_point():
                values = entry[m]
                layout = state_layout(tuple(values.shape), group.get("flat_layout", False)) \
                    if group.get("quantize_states", True) else None
                if layout is None:
                    continue
                codes, scales = quantize_moment(m, values.float(), layout[1], companded)
                del entry[m]
                entry[f"{m}_codes"], entry[f"{m}_scales"] = codes, scales
        out_state[name] = entry
    progress("optimizer state", len(state), len(state))
    groups_out = [dict(g, flashdist_format=fmt, flashdist_version=FORMAT_VERSION) for g in optim.get("param_groups", [])]
    return {"state": out_state, "param_groups": groups_out}


# ----- inspect ----------------------------------------------------------------------------------------------


def _size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint is, without loading its tensors where the format allows (DCP: metadata plus the
    few small plain-data entries; safetensors: the header)."""
    path = Path(path)
    kind = detect(path)
    info: dict[str, Any] = {"path": str(path), "kind": kind}
    if kind == "dcp":
        where = resolve(path)
        entries = dcp_entries(where)
        small = [k for k, (route, size, _) in entries.items()
                 if size is None and route[:2] == ("optim", "param_groups")]
        groups = read_dcp(where, small).get("optim", {}).get("param_groups", []) if small else []
        tensors = {k: v for k, v in entries.items() if v[1] is not None}
        model = {k: v for k, v in tensors.items() if v[0][0] == "model"}
        optim = {k: v for k, v in tensors.items() if v[0][0] == "optim"}
        info["saved_world_size"] = len({f.name for f in where.glob("*.distcp")})
        info["path"] = str(where)
    else:
        state = read(path)
        if kind == "deepspeed":
            from .deepspeed_import import describe

            ds = describe(path)
            info.update(path=ds["folder"], zero_stage=ds["zero_stage"], deepspeed_masters=ds["masters"],
                        deepspeed_version=ds["ds_version"])
        groups = state.get("optim", {}).get("param_groups", [])
        flat, _ = _flat_tensors(state)
        tensors = {".".join(map(str, r)): (r, tuple(t.shape), t.dtype) for r, t in flat.items()}
        model = {k: v for k, v in tensors.items() if v[0][0] == "model"}
        optim = {k: v for k, v in tensors.items() if v[0][0] == "optim"}
        info["saved_world_size"] = ds["world_size"] if kind == "deepspeed" else None  # a file: full tensors
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
                                                             ("compressed" if any(k.endswith("_codes") for k in optim_keys)
                                                              else ("portable" if optim_keys else None))),
        "format_version": max((g.get("flashdist_version", 0) for g in groups), default=None),
        "master_weight_bits": sorted({g.get("master_weight_bits") for g in groups}, key=str) if groups else None,
        "optimizer_state_keys": sorted(optim_keys),
        "bytes_on_disk": _size_on_disk(Path(info["path"])),
    })
    steps = [k for k, (route, size, _) in optim.items() if route[-1] == "step" and size == ()]
    if steps:
        first = steps[0]
        node = read_dcp(path, [first]) if kind == "dcp" else state  # a file was read whole above
        for part in optim[first][0]:
            node = node[part]
        info["step"] = int(float(node))
    info["bytes_per_param"] = info["bytes_on_disk"] / n_params if n_params else None
    return info


# ----- convert / export -------------------------------------------------------------------------------------


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, fmt: str | None = None, force: bool = False,
            progress: Progress = _quiet, tag: str | None = None, master_weight_bits: int | None = None) -> Path:
    """Read ``src`` (any KIND), optionally switch its optimizer-state format, write ``dst`` as ``to``.
    ``tag`` and ``master_weight_bits``: for a DeepSpeed ``src`` (:func:`read`). Nothing is written unless the
    whole of ``src`` was read and checked."""
    if to not in ("dcp", "torch", "safetensors"):
        raise CheckpointError(f"flashdist: unknown output format {to!r}; expected dcp, torch or safetensors")
    if Path(dst).exists() and not force:
        raise CheckpointError(f"flashdist: {dst} exists; pass --force to replace it")
    progress("reading", 0, 1)
    state = read(src, tag=tag, master_weight_bits=master_weight_bits, progress=progress)
    progress("reading", 1, 1)
    if fmt is not None and "optim" in state:
        state["optim"] = reformat(state["optim"], fmt, progress)
    return write(state, dst, to, force=force)


def master_weights(state: dict, progress: Progress = _quiet) -> dict[str, torch.Tensor]:
    """fp32 master weights (parameter + rho where the optimizer state has one), keyed by FQN."""
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise CheckpointError("flashdist: the checkpoint has no model weights ('model' entries)")
    opt_state = state.get("optim", {}).get("state", {})
    out = {}
    for i, (name, value) in enumerate(model.items()):
        progress("export", i, len(model))
        rho = opt_state.get(name, {}).get("rho") if isinstance(opt_state.get(name), dict) else None
        if rho is not None and value.dtype in (torch.bfloat16, torch.float16):
            out[name] = R.merge(value, rho)
        else:
            out[name] = value.float() if value.is_floating_point() else value
    progress("export", len(model), len(model))
    return out


def export(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
           progress: Progress = _quiet) -> Path:
    """fp32 master weights of checkpoint ``src`` as a safetensors file keyed by the model's FQNs."""
    from safetensors.torch import save_file

    dst = Path(dst)
    tmp = _prepare(dst, force)
    # a DeepSpeed folder's fp32 master partitions (a flashoptim file's ECC masters) survive all 32 bits in an
    # int16 rho (24 bits would round them)
    weights = master_weights(read(src, master_weight_bits=32) if detect(src) in ("deepspeed", "flashoptim")
                             else read(src), progress)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    _commit(tmp, dst)
    return dst
