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
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..quant import rho as R
from torch.distributed.checkpoint.api import CheckpointException

from .dcp import CheckpointError, SafeFileSystemReader, SafeLoadPlanner, resolve, short_error
from .output import Fetch, Spec, atomic_output, check_destination, write_dcp, write_safetensors, write_torch
from .state import FORMAT_VERSION, FORMATS, dequantize_moment, quantize_moment

KINDS = ("dcp", "torch", "safetensors", "deepspeed", "flashoptim")
OUTPUTS = ("dcp", "torch", "safetensors")
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


def dcp_entries(path: str | os.PathLike, metadata=None) -> dict[str, tuple]:
    """Flat key -> (route in the nested dict, size or None for plain data, dtype or None), metadata only."""
    md = metadata if metadata is not None else SafeFileSystemReader(str(resolve(path))).read_metadata()
    routes = md.planner_data or {}
    out = {}
    for key, meta in md.state_dict_metadata.items():
        route = tuple(routes.get(key, key.split(".")))
        if isinstance(meta, BytesStorageMetadata):
            out[key] = (route, None, None)
        else:
            out[key] = (route, tuple(meta.size), meta.properties.dtype)
    return out


class _KnownMetadataReader(SafeFileSystemReader):
    """A reader for one more dcp.load of a checkpoint whose metadata was read already (once per conversion,
    not once per tensor: the metadata of a large checkpoint takes a while to unpickle). Each shard file goes
    through the safe reader's checks on its first read; the files in ``checked`` (shared by the reads of one
    conversion) are read without checking them again."""

    def __init__(self, path: str, metadata, checked: set | None = None):
        super().__init__(path)
        self.known, self.checked = metadata, checked if checked is not None else set()

    def read_metadata(self, *args: Any, **kwargs: Any):
        return self.known

    def read_data(self, plan, planner):
        files = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        if files <= self.checked:
            return FileSystemReader.read_data(self, plan, planner)
        result = super().read_data(plan, planner)
        self.checked |= files
        return result


def read_dcp(path: str | os.PathLike, keys: list[str] | None = None, *, metadata=None, checked: set | None = None
             ) -> dict:
    """Load (some flat keys of) a DCP checkpoint into a nested dict of full CPU tensors, in this process.
    ``metadata``: the checkpoint's, when the caller has read it already; ``checked``: its shard files already
    checked by an earlier read (see :class:`_KnownMetadataReader`)."""
    where = resolve(path)
    if metadata is None:
        metadata = SafeFileSystemReader(str(where)).read_metadata()
    entries = dcp_entries(where, metadata)
    wanted = entries if keys is None else {k: entries[k] for k in keys}
    nested: dict = {}
    for route, size, dtype in wanted.values():
        _set(nested, route, torch.empty(size, dtype=dtype) if size is not None else None)
    try:
        # the top level must be dicts: dcp.load copies it, and plain-data entries land in nested dicts
        dcp.load(nested, storage_reader=_KnownMetadataReader(str(where), metadata, checked), planner=SafeLoadPlanner(),
                 no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps read failures (missing/truncated shard files)
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {short_error(e)}") from e
    return nested


def _read_safetensors(path: Path) -> dict:
    from safetensors import safe_open

    nested: dict = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "flashdist" in meta:
            nested = _from_json(meta["flashdist"])
        for key in f.keys():
            route = tuple(json.loads(meta.get(f"route:{key}", "null")) or key.split("."))
            _set(nested, route, f.get_tensor(key))
    return nested


def read(path: str | os.PathLike, *, tag: str | None = None, master_weight_bits: int | None = None,
         progress: Progress = _quiet) -> dict:
    """The whole checkpoint as a nested dict (tensors on the CPU). ``tag`` and ``master_weight_bits`` apply to
    DeepSpeed folders only (see :func:`flashdist.checkpoint.deepspeed_import.read_deepspeed`)."""
    kind = detect(path)
    _check_options(path, kind, tag, master_weight_bits)
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


# ----- streaming sources ------------------------------------------------------------------------------------


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
        # a tuple of plain data stays a tuple (param groups' betas); one holding tensors becomes a list
        return tensors, (tuple(rest) if isinstance(nested, tuple) and not tensors else rest)
    return tensors, nested


class Source:
    """A checkpoint opened for streaming: ``rest`` (the nested dict, each tensor None), ``specs`` (route ->
    (shape, dtype), in the checkpoint's order) and :meth:`get`, which reads the tensors of a few routes. A DCP
    folder, a torch file and a safetensors file are read tensor by tensor; a DeepSpeed folder or a flashoptim
    file is reassembled in memory first (:func:`read`)."""

    def __init__(self, rest, specs: dict[tuple, Spec]):
        self.rest, self.specs = rest, specs

    def get(self, routes: list[tuple]) -> dict[tuple, torch.Tensor]:
        raise NotImplementedError


class _MemorySource(Source):
    def __init__(self, state: dict):
        self.tensors, rest = _flat_tensors(state)
        super().__init__(rest, {r: (tuple(t.shape), t.dtype) for r, t in self.tensors.items()})

    def get(self, routes):
        return {r: self.tensors[r] for r in routes}


class _DcpSource(Source):
    def __init__(self, path):
        self.path = resolve(path)
        self.metadata = SafeFileSystemReader(str(self.path)).read_metadata()
        self.checked: set = set()
        entries = dcp_entries(self.path, self.metadata)
        self.keys = {route: key for key, (route, size, _) in entries.items() if size is not None}
        plain = [k for k, (_, size, _) in entries.items() if size is None]
        rest = read_dcp(self.path, plain, metadata=self.metadata, checked=self.checked) if plain else {}
        for key, (route, size, dtype) in entries.items():
            if size is not None:
                _set(rest, route, None)
        super().__init__(rest, {route: (size, dtype) for route, size, dtype in entries.values() if size is not None})

    def get(self, routes):
        nested = read_dcp(self.path, [self.keys[r] for r in routes], metadata=self.metadata, checked=self.checked)
        return {r: _at(nested, r) for r in routes}


class _TorchSource(Source):
    # torch.load(mmap=True) maps the file without reading it; each get maps it afresh and copies its tensors out,
    # so the pages it touched are unmapped when the copies are returned
    def __init__(self, path: Path):
        self.path = path
        state = self._load()
        tensors, rest = _flat_tensors(state)
        super().__init__(rest, {r: (tuple(t.shape), t.dtype) for r, t in tensors.items()})

    def _load(self):
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
            raise CheckpointError(f"flashdist: could not read {self.path}: {str(e).splitlines()[0][:300]}") from None

    def get(self, routes):
        state = self._load()
        return {r: _at(state, r).clone() for r in routes}


class _SafetensorsSource(Source):
    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                rest = _from_json(meta["flashdist"]) if "flashdist" in meta else {}
                self.keys, specs = {}, {}
                for key in f.keys():
                    route = tuple(json.loads(meta.get(f"route:{key}", "null")) or key.split("."))
                    sl = f.get_slice(key)
                    self.keys[route] = key
                    specs[route] = (tuple(sl.get_shape()), _dtype_of(sl.get_dtype()))
                    _set(rest, route, None)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"flashdist: could not read {path}: {str(e).splitlines()[0][:300]}") from None
        super().__init__(rest, specs)

    def get(self, routes):
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:  # mapped for this read only
            return {r: f.get_tensor(self.keys[r]).clone() for r in routes}


def _dtype_of(name: str) -> torch.dtype:
    from .output import SAFETENSORS_DTYPES

    for dtype, code in SAFETENSORS_DTYPES.items():
        if code == name:
            return dtype
    raise CheckpointError(f"flashdist: safetensors dtype {name} is not supported")


def _at(nested, route):
    for part in route:
        nested = nested[part]
    return nested


def open_source(path: str | os.PathLike, *, tag: str | None = None, master_weight_bits: int | None = None,
                progress: Progress = _quiet) -> Source:
    """``path`` (any KIND) opened for streaming (see :class:`Source`)."""
    kind = detect(path)
    if kind == "dcp":
        _check_options(path, kind, tag, master_weight_bits)
        return _DcpSource(path)
    if kind == "torch":
        _check_options(path, kind, tag, master_weight_bits)
        try:
            return _TorchSource(Path(path))
        except CheckpointError:  # e.g. a file of torch's legacy format, which cannot be mapped: read it whole
            return _MemorySource(read(path))
    if kind == "safetensors":
        _check_options(path, kind, tag, master_weight_bits)
        return _SafetensorsSource(Path(path))
    return _MemorySource(read(path, tag=tag, master_weight_bits=master_weight_bits, progress=progress))


class _Fetcher:
    """Random-access ``fetch(route)`` over a source, for writers that ask in their own order. ``compute`` maps
    a group of routes (one parameter's optimizer state) to their tensors at once; those not yet asked for are
    kept, within ``budget`` bytes (oldest dropped first, recomputed if asked again)."""

    def __init__(self, source: Source, derived: dict[tuple, tuple] | None = None,
                 compute: Callable[[tuple], dict[tuple, torch.Tensor]] | None = None, budget: int = 16 * 2**20,
                 order: list[tuple] | None = None):
        self.source, self.derived, self.compute, self.budget = source, derived or {}, compute, budget
        self.kept: dict[tuple, torch.Tensor] = {}
        # each read also takes the next routes of ``order`` (default: the source's, which most writers follow),
        # within the budget: one read per batch of small tensors rather than one per tensor
        self.order = order if order is not None else [r for r in source.specs if r not in self.derived]
        self.position = {r: i for i, r in enumerate(self.order)}

    def _batch(self, route: tuple) -> list[tuple]:
        batch, size = [route], _spec_bytes(self.source.specs[route])
        if route not in self.position:
            return batch
        for nxt in self.order[self.position[route] + 1:]:
            size += _spec_bytes(self.source.specs[nxt])
            if size > self.budget:
                break
            if nxt not in self.kept and nxt not in batch:
                batch.append(nxt)
        return batch

    def __call__(self, route: tuple) -> torch.Tensor:
        if route in self.kept:
            return self.kept.pop(route)
        if route not in self.derived:
            out = self.source.get(self._batch(route))
        else:
            out = self.compute(self.derived[route])
        t = out.pop(route)
        self.kept.update(out)
        while self.kept and sum(v.numel() * v.element_size() for v in self.kept.values()) > self.budget:
            self.kept.pop(next(iter(self.kept)))
        return t


def _spec_bytes(spec: Spec) -> int:
    return int(torch.Size(spec[0]).numel()) * spec[1].itemsize


def _check_options(path, kind: str, tag, master_weight_bits) -> None:
    if (kind != "deepspeed" and tag is not None) or (kind not in ("deepspeed", "flashoptim") and
                                                     master_weight_bits is not None):
        raise CheckpointError(f"flashdist: {path} is a {kind} checkpoint; a tag and master_weight_bits apply to "
                              "DeepSpeed checkpoints only (master_weight_bits: flashoptim files too)")


# ----- writing ----------------------------------------------------------------------------------------------


def _write(kind: str, dst: Path, rest, specs: dict[tuple, Spec], fetch: Fetch, progress: Progress) -> None:
    with atomic_output(dst, directory=kind == "dcp") as tmp:
        if kind == "dcp":
            write_dcp(tmp, rest, specs, fetch)
        elif kind == "torch":
            write_torch(tmp, rest, specs, fetch, progress)
        else:
            names = {".".join(map(str, route)): route for route in specs}
            meta = {"flashdist": _json_header(rest, dst)}
            meta.update({f"route:{name}": json.dumps(list(route)) for name, route in names.items()})
            write_safetensors(tmp, {n: specs[r] for n, r in names.items()}, lambda n: fetch(names[n]), meta,
                              progress)


def _json_header(rest, dst) -> str:
    """The plain data of a checkpoint as JSON (safetensors keeps it in its header); torch dtypes as their names."""
    def plain(x):
        if isinstance(x, torch.dtype):
            return {_DTYPE_TAG: str(x).removeprefix("torch.")}
        if isinstance(x, torch.Size):
            return list(x)
        raise TypeError(f"a {type(x).__name__} ({x!r:.60})")

    try:
        return json.dumps(rest, default=plain)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"flashdist: cannot store the checkpoint's plain data in {dst}: {e} is not JSON; "
                              "convert --to torch or --to dcp instead") from None


_DTYPE_TAG = "__torch.dtype__"


def _from_json(text: str):
    def hook(obj):
        if len(obj) == 1 and _DTYPE_TAG in obj and isinstance(getattr(torch, str(obj[_DTYPE_TAG]), None), torch.dtype):
            return getattr(torch, obj[_DTYPE_TAG])
        return obj

    return json.loads(text, object_hook=hook)


def write(state: dict, dst: str | os.PathLike, to: str, *, force: bool = False) -> Path:
    """Write a nested checkpoint dict as ``to`` (dcp, torch or safetensors), atomically."""
    if to not in OUTPUTS:
        raise CheckpointError(f"flashdist: unknown output format {to!r}; expected dcp, torch or safetensors")
    dst = Path(dst)
    check_destination([], dst, to, force)
    source = _MemorySource(state)
    _write(to, dst, source.rest, source.specs, _Fetcher(source), _quiet)
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
    _check_format(fmt)
    groups = _groups_by_param(optim)
    state = optim.get("state", {})
    out_state = {}
    for i, (name, entry) in enumerate(state.items()):
        progress("optimizer state", i, len(state))
        out_state[name] = _reformat_entry(entry, groups.get(name, {}), fmt)
    progress("optimizer state", len(state), len(state))
    return {"state": out_state, "param_groups": _reformat_groups(optim.get("param_groups", []), fmt)}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise CheckpointError(f"flashdist: unknown optimizer-state format {fmt!r}; expected one of {FORMATS}")


def _reformat_groups(groups: list, fmt: str) -> list:
    return [dict(g, flashdist_format=fmt, flashdist_version=FORMAT_VERSION) for g in groups]


def _reformat_entry(entry: dict, group: dict, fmt: str) -> dict:
    """One parameter's optimizer state in format ``fmt``. Works on meta tensors too (the output's shapes)."""
    from ..optim.base import state_layout

    companded = group.get("companded", True)
    entry = dict(entry)
    moments = sorted({k[: -len("_codes")] for k in entry if k.endswith("_codes")} |
                     {k for k in entry if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")})
    for m in moments:
        if fmt == "portable" and f"{m}_codes" in entry:
            codes, scales = entry.pop(f"{m}_codes"), entry.pop(f"{m}_scales")
            layout = state_layout(tuple(codes.shape), group.get("flat_layout", False))
            pieces = _pieces(codes, layout)
            if len(pieces) == 1:
                entry[m] = dequantize_moment(m, codes, scales, layout[1], companded)
                continue
            values = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
            for part in pieces:
                values[part] = dequantize_moment(m, codes[part], scales[part], layout[1], companded)
            entry[m] = values
        elif fmt == "compressed" and isinstance(entry.get(m), torch.Tensor) and entry[m].is_floating_point():
            values = entry[m]
            layout = state_layout(tuple(values.shape), group.get("flat_layout", False)) \
                if group.get("quantize_states", True) else None
            if layout is None:
                continue
            quantized = [quantize_moment(m, values[part].float(), layout[1], companded)
                         for part in _pieces(values, layout)]
            del entry[m]
            entry[f"{m}_codes"] = torch.cat([c for c, _ in quantized]) if len(quantized) > 1 else quantized[0][0]
            entry[f"{m}_scales"] = torch.cat([s for _, s in quantized]) if len(quantized) > 1 else quantized[0][1]
    return entry


_VALUES_PER_PIECE = 2**20  # a large moment is (de)quantized in pieces of whole rows: the float temporaries stay small


def _pieces(t: torch.Tensor, layout: tuple) -> list[slice]:
    """Slices of whole rows of a row-aligned moment (groups never cross rows, so each piece quantizes as it
    does in the whole tensor); one slice, the whole, for a single row (the flat layout) or a small tensor."""
    if layout[0] <= 1 or t.dim() == 0 or t.numel() <= _VALUES_PER_PIECE:
        return [slice(None)]
    step = max(1, _VALUES_PER_PIECE // max(layout[1], 1))
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
        for k, t in _reformat_entry(meta, groups.get(name, {}), fmt).items():
            new_state[name][k] = None
            out_specs[("optim", "state", name, k)] = (tuple(t.shape), t.dtype)
            if k not in inputs[name] or specs[inputs[name][k]] != out_specs[("optim", "state", name, k)]:
                # made from one moment (its values, or its codes and scales); the rest is read as it is
                derived[("optim", "state", name, k)] = (name, k.removesuffix("_codes").removesuffix("_scales"))
    new_state.update({n: e for n, e in optim["state"].items() if n not in new_state})
    rest = dict(rest, optim=dict(optim, state=new_state,
                                 param_groups=_reformat_groups(optim.get("param_groups", []), fmt)))

    def compute(what) -> dict[tuple, torch.Tensor]:
        name, moment = what
        routes = {k: r for k, r in inputs[name].items() if k in (moment, f"{moment}_codes", f"{moment}_scales")}
        got = source.get(list(routes.values()))
        entry = _reformat_entry({k: got[r] for k, r in routes.items()}, groups.get(name, {}), fmt)
        return {("optim", "state", name, k): v for k, v in entry.items()}

    return rest, out_specs, derived, compute


# ----- inspect ----------------------------------------------------------------------------------------------


def _size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def saved_world_size(path: str | os.PathLike) -> int:
    """How many ranks wrote DCP checkpoint ``path``, from the files its .metadata names (``__<rank>_<n>.distcp``);
    other files in the folder do not count."""
    md = SafeFileSystemReader(str(resolve(path))).read_metadata()
    files = {str(info.relative_path) for info in (md.storage_data or {}).values()}
    ranks = {m.group(1) for f in files if (m := re.match(r"^__(\d+)_\d+\.distcp$", f))}
    return len(ranks) or len(files)


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
        info["saved_world_size"] = saved_world_size(where)
        info["path"] = str(where)
    else:
        source = open_source(path)  # a torch or safetensors file: the structure, no tensor read
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
        if kind == "dcp":
            node = _at(read_dcp(path, [first]), optim[first][0])
        else:
            node = source.get([optim[first][0]])[optim[first][0]]
        info["step"] = int(float(node))
    info["bytes_per_param"] = info["bytes_on_disk"] / n_params if n_params else None
    return info


# ----- convert / export -------------------------------------------------------------------------------------


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, fmt: str | None = None, force: bool = False,
            progress: Progress = _quiet, tag: str | None = None, master_weight_bits: int | None = None) -> Path:
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
    source = open_source(src, tag=tag, master_weight_bits=master_weight_bits, progress=progress)
    rest, specs, derived, compute = (source.rest, source.specs, {}, None) if fmt is None else \
        _reformat_plan(source, fmt)
    order = [r for r in specs if r not in derived]  # what the writers ask for, in their usual order
    _write(to, dst, rest, specs, _Fetcher(source, derived, compute, order=order), progress)
    return dst


def _master_plan(source: Source, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Spec], Callable[[str], torch.Tensor]]:
    """The model's weights as master weights in ``dtype`` (parameter + rho where the optimizer state has one),
    keyed by FQN: their specs, and a function that reads one. A tied parameter (embedding = LM head) is saved
    under each name but its optimizer state under one: a model entry that no param group lists, without rho,
    bit-identical to a parameter with rho, is that parameter's alias and gets its master weight."""
    model = {route[1]: route for route in source.specs if route[0] == "model" and len(route) == 2}
    if not model:
        raise CheckpointError("flashdist: the checkpoint has no model weights ('model' entries)")
    rho = {name: ("optim", "state", name, "rho") for name in model if ("optim", "state", name, "rho") in source.specs}
    optim = source.rest.get("optim", {}) if isinstance(source.rest, dict) else {}
    listed = set(_groups_by_param(optim)) if isinstance(optim, dict) else set()
    alias: dict[str, str] = {}
    for name, route in model.items():
        if name in rho or name in listed or source.specs[route][1] not in (torch.bfloat16, torch.float16):
            continue
        for other in rho:
            if source.specs[model[other]] == source.specs[route]:
                got = source.get([route, model[other]])
                if torch.equal(got[route].view(torch.int16), got[model[other]].view(torch.int16)):
                    alias[name] = other
                    break
    specs = {}
    for name, route in model.items():
        shape, have = source.specs[route]
        specs[name] = (shape, dtype if have.is_floating_point else have)

    order = []
    for name in specs:
        order += [model[alias.get(name, name)]] + ([rho[alias.get(name, name)]] if alias.get(name, name) in rho else [])
    get = _Fetcher(source, order=order)

    def fetch(name: str) -> torch.Tensor:
        owner = alias.get(name, name)
        value = get(model[owner])
        if owner in rho:
            r = get(rho[owner])
            if value.dtype in (torch.bfloat16, torch.float16):
                return _merge(value, r, dtype)
        return value.to(dtype) if value.is_floating_point() else value

    return specs, fetch


def _merge(value: torch.Tensor, rho: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """R.merge in pieces (it is elementwise): its fp32 temporaries stay small whatever the tensor's size."""
    out = torch.empty(value.shape, dtype=dtype)
    flat_out, flat_value, flat_rho = out.view(-1), value.reshape(-1), rho.reshape(-1)
    step = 2**18
    for i in range(0, flat_out.numel(), step):
        flat_out[i:i + step] = R.merge(flat_value[i:i + step], flat_rho[i:i + step])
    return out


def master_weights(state: dict, progress: Progress = _quiet) -> dict[str, torch.Tensor]:
    """fp32 master weights (parameter + rho where the optimizer state has one), keyed by FQN; a tied
    parameter under each of its names (see :func:`export`)."""
    specs, fetch = _master_plan(_MemorySource(state))
    out = {}
    for i, name in enumerate(specs):
        progress("export", i, len(specs))
        out[name] = fetch(name)
    progress("export", len(specs), len(specs))
    return out


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False, progress: Progress = _quiet,
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
