"""Reading checkpoints of every kind flashdist knows, whole (:func:`read`) or tensor by tensor
(:func:`open_source`, :class:`Fetcher`), into the nested dict that :func:`flashdist.checkpoint.save` writes:
``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}, "extra": {...}}``.

- DCP directory: read through the safe reader (no code-running pickles), one tensor at a time where the
  operation allows. torchtitan's layout (weights at top-level keys, the optimizer state flattened per
  parameter name) is read under flashdist's routes (:func:`titan_routes`).
- torch file: ``torch.save`` of that dict; read with ``weights_only=True``.
- safetensors file: tensors under flat keys (``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``extra.<key>``);
  everything else (param groups, plain extras) as JSON in the header metadata under ``flashdist``
  (:func:`json_header`).
- DeepSpeed ZeRO 1/2/3 folder (``engine.save_checkpoint`` with a flashdist optimizer): read only, through
  :func:`flashdist.checkpoint.deepspeed_import.read_deepspeed` (every rank's partitions reassembled per
  parameter; portable optimizer state; parameter + rho; for ``inspect`` on meta tensors, no data read).
- Hugging Face Trainer ``checkpoint-N`` folder (model weights + ``optimizer.pt``) or Accelerate ``save_state``
  folder (model weights + ``optimizer.bin``): read only, tensor by tensor, through
  :class:`flashdist.checkpoint.trainer_files.TrainerSource`. A PEFT adapter-only folder is refused. The same
  folders written under FSDP with a sharded state dict (``pytorch_model_fsdp_0`` and ``optimizer_0``, two DCP
  checkpoints): read only, whole, through :func:`read_fsdp_folder` (its structure alone from the metadata, for
  ``inspect``).
- flashoptim torch file (``{"model": ..., "optimizer": ...}`` of the FlashOptim paper's library): read only,
  through :func:`flashdist.checkpoint.flashoptim_import.read_flashoptim`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .dcp_files import SafeFileSystemReader, SafeLoadPlanner
from .errors import CheckpointError, error_summary
from .files import (check_nesting, check_routes, check_safetensors_file, check_torch_file, inside, open_regular,
                    reason)
from .names import storage_place
from .output import Spec
from .publish import resolve

KINDS = ("dcp", "torch", "safetensors", "deepspeed", "flashoptim", "trainer", "fsdp-folder")
Progress = Callable[[str, int, int], None]


def quiet(_what: str, _done: int, _total: int) -> None:
    """A :data:`Progress` callback that reports nothing (the default of every long operation)."""


def detect(path: str | os.PathLike) -> str:
    """What ``path`` is: one of KINDS. Raises CheckpointError if it is none of them."""
    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").exists():
            return "dcp"
        if ((path / "latest").exists() or any(path.glob("*/mp_rank_*_model_states.pt"))
                or any(path.glob("*/zero_pp_rank_*")) or any(path.glob("*_optim_states.pt"))):
            return "deepspeed"
        from .trainer_files import is_adapter_folder, is_fsdp_folder, is_trainer_folder

        if is_trainer_folder(path):
            return "trainer"
        if is_fsdp_folder(path):
            return "fsdp-folder"
        if is_adapter_folder(path):
            raise CheckpointError(
                f"flashdist: {path} is a PEFT adapter checkpoint (adapter_config.json, no full model weights): its "
                "optimizer state is keyed by index and the adapters' order in the model is not in the folder, so "
                "no masters can be attached; resume it with the Trainer, or save the model and optimizer with "
                "flashdist.checkpoint.save (state keyed by name) to export")
        raise CheckpointError(f"flashdist: {path} is a directory but neither a DCP checkpoint (.metadata), a "
                              "DeepSpeed checkpoint (latest, */mp_rank_*_model_states.pt, *_optim_states.pt) nor a "
                              "Trainer checkpoint-N or Accelerate save_state folder (optimizer.pt or optimizer.bin "
                              "and model.safetensors or pytorch_model.bin; under FSDP pytorch_model_fsdp_0 and "
                              "optimizer_0)")
    if not path.exists():
        old = path.with_name(path.name + ".old")
        if (old / ".metadata").exists():
            return "dcp"
        raise CheckpointError(f"flashdist: no such file or directory: {path}")
    with open_regular(path, expected="a checkpoint file") as f:  # a FIFO or a device is refused, never read
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        first = f.read(1) if len(head) == 8 and 0 < int.from_bytes(head, "little") < 100 * 2**20 else b""
    if head[:2] == b"PK":
        from .flashoptim_import import is_flashoptim_file

        return "flashoptim" if is_flashoptim_file(path) else "torch"
    if first == b"{" and size >= 8 + int.from_bytes(head, "little"):
        return "safetensors"
    raise CheckpointError(f"flashdist: {path} is not a DCP directory, a torch file or a safetensors file")


# ----- reading ----------------------------------------------------------------------------------------------


def _set(root: dict, route: tuple, value) -> None:
    """Put ``value`` at ``route`` in ``root``, growing lists to the index (checked beforehand with
    :func:`~flashdist.checkpoint.files.check_routes`, so a route cannot make a list longer than its file pays
    for). A route through a plain value, or a name into a list, raises :class:`CheckpointError`."""
    node = root
    for i, part in enumerate(route):
        last = i == len(route) - 1
        if isinstance(node, list) and isinstance(part, int) and not isinstance(part, bool) and part >= 0:
            while len(node) <= part:
                node.append(None if last else ({} if not isinstance(route[i + 1], int) else []))
            if last:
                node[part] = value
            elif node[part] is None:
                node[part] = {} if not isinstance(route[i + 1], int) else []
        elif isinstance(node, dict) and isinstance(part, (str, int)):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, [] if isinstance(route[i + 1], int) else {})
                continue
        else:
            raise CheckpointError(f"flashdist: the checkpoint's entry route {list(route)[:8]} does not fit its other "
                                  "entries; the checkpoint is damaged or crafted")
        if not last:
            node = node[part]


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
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {error_summary(e)}") from e
    return nested


def _dcp_structure(path: str | os.PathLike) -> dict:
    """A DCP checkpoint's nested dict from its metadata: each tensor a meta tensor of its shape and dtype, but
    the 0-d ones (step counts), which are read with the optimizer's param groups; other plain data is None.
    Memory: the metadata's, whatever the size of the shards."""
    where = resolve(path)
    metadata = SafeFileSystemReader(str(where)).read_metadata()
    entries = dcp_entries(where, metadata)
    nested: dict = {}
    for route, size, dtype in entries.values():  # (in the checkpoint's order)
        _set(nested, route, torch.empty(size, dtype=dtype, device="meta") if size is not None else None)
    small = [k for k, (route, size, _) in entries.items()
             if size == () or (size is None and route[1:2] == ("param_groups",))]
    if small:
        read = read_dcp(where, small, metadata=metadata)
        for key in small:
            _set(nested, entries[key][0], value_at(read, entries[key][0]))
    return nested


def read_fsdp_folder(path: str | os.PathLike, *, structure: bool = False) -> dict:
    """The checkpoint in an FSDP folder (:func:`flashdist.checkpoint.trainer_files.is_fsdp_folder`), whole, as
    flashdist's nested dict. Accelerate writes ``{"model": model.state_dict()}`` to ``pytorch_model_fsdp_0`` and
    ``{"optimizer": get_optimizer_state_dict(model, optimizer)}`` to ``optimizer_0``: the optimizer state keyed
    by parameter name (torch's distributed state dict), so the masters need no parameter order. Read through
    flashdist's safe DCP reader; a folder of several models or optimizers is refused. ``structure``: meta
    tensors from the two folders' metadata, only the step counts and param groups read (``inspect``)."""
    from .trainer_files import FSDP_MODEL, FSDP_OPTIMIZER, fsdp_global_step

    folder = Path(path)
    extra = [n for n in ("pytorch_model_fsdp_1", "optimizer_1") if (folder / n).exists()]
    if extra:
        raise CheckpointError(f"flashdist: {folder} holds several models or optimizers ({extra[0]}); flashdist reads "
                              "a folder of one model and one optimizer: save each with flashdist.checkpoint.save")
    read_one = _dcp_structure if structure else read_dcp
    model = read_one(inside(folder, FSDP_MODEL)).get("model")
    optim = read_one(inside(folder, FSDP_OPTIMIZER)).get("optimizer")
    if not isinstance(model, dict) or not isinstance(optim, dict) or not isinstance(optim.get("state"), dict):
        raise CheckpointError(f"flashdist: {folder} does not hold Accelerate's FSDP layout ('model' in {FSDP_MODEL}, "
                              f"'optimizer' with its state in {FSDP_OPTIMIZER}); it is damaged or was written by "
                              "another program")
    step = fsdp_global_step(folder)
    return {"model": model, "optim": {"state": optim["state"], "param_groups": optim.get("param_groups", [])},
            "extra": {"step": step}}


def _safetensors_routes(path: Path, f) -> tuple[dict, dict[str, tuple]]:
    """The plain data of an open safetensors file and the route of each of its tensors, checked
    (:func:`~flashdist.checkpoint.files.check_routes`) before anything is built from them."""
    meta = f.metadata() or {}
    rest = _from_json(meta["flashdist"]) if "flashdist" in meta else {}
    routes = {key: tuple(json.loads(meta.get(f"route:{key}", "null")) or key.split(".")) for key in f.keys()}
    check_routes(routes.values(), slack=len(meta.get("flashdist", "")) + 64, source=path)
    return rest, routes


def _read_safetensors(path: Path) -> dict:
    from safetensors import safe_open

    check_safetensors_file(path)
    with safe_open(str(path), framework="pt") as f:
        nested, routes = _safetensors_routes(path, f)
        for key, route in routes.items():
            _set(nested, route, f.get_tensor(key))
    return nested


def read(path: str | os.PathLike, *, tag: str | None = None, master_weight_bits: int | None = None,
         progress: Progress = quiet, structure: bool = False) -> dict:
    """The whole checkpoint as a nested dict (tensors on the CPU). ``tag`` and ``master_weight_bits`` apply to
    DeepSpeed folders only (see :func:`flashdist.checkpoint.deepspeed_import.read_deepspeed`). ``structure``
    (DeepSpeed folders, flashoptim files and FSDP folders): meta tensors, no tensor data read (the step counts
    excepted)."""
    kind = detect(path)
    _check_options(path, kind, tag, master_weight_bits)
    if kind == "flashoptim":
        from .flashoptim_import import read_flashoptim

        return _whole(path, read_flashoptim, path, master_weight_bits=master_weight_bits, structure=structure)
    if kind == "dcp":
        metadata = SafeFileSystemReader(str(resolve(path))).read_metadata()
        if titan_routes(dcp_entries(path, metadata)) is not None:
            return _DcpSource(path).read()
        return read_dcp(path, metadata=metadata)
    if kind == "trainer":
        from .trainer_files import TrainerSource

        return TrainerSource(path).read()
    if kind == "fsdp-folder":
        return read_fsdp_folder(path, structure=structure)
    if kind == "torch":
        check_torch_file(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
            raise CheckpointError(f"flashdist: could not read {path}: {_first_line(e)}") from None
        check_nesting(state, path)
        return state
    if kind == "safetensors":
        try:
            return _read_safetensors(Path(path))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"flashdist: could not read {path}: {_first_line(e)}") from None
    from .deepspeed_import import read_deepspeed

    return _whole(path, read_deepspeed, path, tag, master_weight_bits=master_weight_bits, progress=progress,
                  structure=structure)


def _whole(path, reader: Callable, *args, **kwargs) -> dict:
    """``reader(*args, **kwargs)`` (a DeepSpeed folder's or a flashoptim file's), whose failure on a file of
    unexpected structure (a type, a key or an index it does not have) is a :class:`CheckpointError` naming
    ``path``."""
    try:
        return reader(*args, **kwargs)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"flashdist: could not read {path}: it does not hold what a checkpoint of its kind "
                              f"holds ({reason(e)}); it is damaged or was written by another program") from None


# ----- streaming sources ------------------------------------------------------------------------------------


def flat_tensors(nested, prefix: tuple = ()) -> tuple[dict[tuple, torch.Tensor], Any]:
    """Split a nested checkpoint into {route: tensor} and the same structure with each tensor as None."""
    if isinstance(nested, torch.Tensor):
        return {prefix: nested}, None
    tensors: dict[tuple, torch.Tensor] = {}
    if isinstance(nested, dict):
        rest = {}
        for k, v in nested.items():
            t, rest[k] = flat_tensors(v, prefix + (k,))
            tensors.update(t)
        return tensors, rest
    if isinstance(nested, (list, tuple)):
        rest = []
        for i, v in enumerate(nested):
            t, r = flat_tensors(v, prefix + (i,))
            tensors.update(t)
            rest.append(r)
        # a tuple of plain data stays a tuple (param groups' betas); one holding tensors becomes a list
        return tensors, (tuple(rest) if isinstance(nested, tuple) and not tensors else rest)
    return tensors, nested


class Source:
    """A checkpoint opened for streaming: ``rest`` (the nested dict, each tensor None), ``specs`` (route ->
    (shape, dtype), in the checkpoint's order) and :meth:`get`, which reads the tensors of a few routes. A DCP
    folder, a torch file and a safetensors file are read tensor by tensor; a DeepSpeed folder or a flashoptim
    file is reassembled in memory first (:func:`read`); as meta tensors where only the structure is wanted
    (:func:`open_source` with ``structure``)."""

    def __init__(self, rest, specs: dict[tuple, Spec]):
        self.rest, self.specs = rest, specs

    def get(self, routes: list[tuple]) -> dict[tuple, torch.Tensor]:
        raise NotImplementedError

    def shared(self, a: tuple, b: tuple) -> bool | None:
        """True where the tensors at routes ``a`` and ``b`` are one tensor saved under two names (a tied weight);
        None where the checkpoint does not tell (a format that stores every name's tensor apart, or tensors
        copied before they were saved, as a state moved to the CPU is)."""
        return None


def _one_tensor(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    return True if storage_place(a) == storage_place(b) else None


class MemorySource(Source):
    """A checkpoint already in memory (a nested dict of tensors) as a :class:`Source`."""

    def __init__(self, state: dict):
        self.tensors, rest = flat_tensors(state)
        super().__init__(rest, {r: (tuple(t.shape), t.dtype) for r, t in self.tensors.items()})

    def get(self, routes):
        return {r: self.tensors[r] for r in routes}

    def shared(self, a, b):
        return _one_tensor(self.tensors[a], self.tensors[b])


_TITAN_OTHERS = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def titan_routes(entries: dict[str, tuple]) -> dict[str, tuple] | None:
    """torchtitan's DCP layout (``CheckpointManager.save``): the model's weights at top-level keys (``proj.weight``)
    and the optimizer state dict flattened by torch (``optimizer.state.<fqn>.<field>``,
    ``optimizer.param_groups.<fqn>.<option>``), beside ``lr_scheduler``, ``dataloader``, ``train_state``. Each
    stored key of :func:`dcp_entries` -> its route in flashdist's layout (``("model", fqn)``, ``("optim",
    "state", fqn, field)``, ``("optim", "by_name", fqn, option)``, grouped by :class:`_DcpSource`); None when the
    checkpoint is not in that layout (it has ``model`` entries, or no flattened optimizer state)."""
    routes = [route for route, _, _ in entries.values()]
    if any(r[0] == "model" for r in routes) or not any(
            r[0] == "optimizer" and len(r) == 2 and str(r[1]).startswith("state.") for r in routes):
        return None
    out = {}
    for key, (route, size, _) in entries.items():
        if route[0] == "optimizer" and len(route) == 2 and isinstance(route[1], str):
            part, _, tail = route[1].partition(".")
            fqn, _, field = tail.rpartition(".")  # a state field or an option has no dot in its name
            if part in ("state", "param_groups") and fqn and field:
                out[key] = ("optim", "state" if part == "state" else "by_name", fqn, field)
        elif len(route) == 1 and size is not None and route[0] not in _TITAN_OTHERS:
            out[key] = ("model", route[0])
    return out


class _DcpSource(Source):
    def __init__(self, path):
        self.path = resolve(path)
        self.metadata = SafeFileSystemReader(str(self.path)).read_metadata()
        self.checked: set = set()
        entries = dcp_entries(self.path, self.metadata)
        self.titan = titan_routes(entries)
        if self.titan is not None:
            self._init_titan(entries)
            return
        self.keys = {route: key for key, (route, size, _) in entries.items() if size is not None}
        plain = [k for k, (_, size, _) in entries.items() if size is None]
        rest = read_dcp(self.path, plain, metadata=self.metadata, checked=self.checked) if plain else {}
        for key, (route, size, dtype) in entries.items():
            if size is not None:
                _set(rest, route, None)
        super().__init__(rest, {route: (size, dtype) for route, size, dtype in entries.values() if size is not None})

    def _init_titan(self, entries: dict[str, tuple]) -> None:
        """torchtitan's layout (:func:`titan_routes`) under flashdist's routes, state keyed by FQN; the
        per-parameter options grouped back into param groups (consecutive parameters with equal options share
        one, of at most as many parameters as its ``flashdist_param_dtypes`` lists)."""
        mapped = {key: (entries[key], route) for key, route in self.titan.items()}
        self.keys = {route: key for key, ((_, size, _), route) in mapped.items() if size is not None}
        self.stored = {route: stored for (stored, size, _), route in mapped.values() if size is not None}
        plain = [key for key, ((_, size, _), _) in mapped.items() if size is None]
        nested = read_dcp(self.path, plain, metadata=self.metadata, checked=self.checked) if plain else {}
        model, state, options = {}, {}, {}
        for key, ((stored, size, _), route) in mapped.items():
            value = None if size is not None else value_at(nested, stored)
            if route[0] == "model":
                model[route[1]] = None
            elif route[1] == "state":
                state.setdefault(route[2], {})[route[3]] = value
            else:
                options.setdefault(route[2], {})[route[3]] = value
        groups: list[dict] = []
        current: dict[str, dict] = {}
        for fqn, opts in options.items():  # in the saved groups' order
            key = repr(sorted(opts.items(), key=lambda kv: kv[0]))
            group, dtypes = current.get(key), opts.get("flashdist_param_dtypes")
            # a group records one dtype per parameter: a full one is followed by a group of the same options
            if group is None or (isinstance(dtypes, list) and len(group["params"]) >= len(dtypes)):
                group = current[key] = {**opts, "params": []}
                groups.append(group)
            group["params"].append(fqn)
        rest = {"model": model, "optim": {"state": state, "param_groups": groups}, "extra": {}}
        Source.__init__(self, rest, {route: (size, dtype) for (_, size, dtype), route in mapped.values()
                                     if size is not None})

    def get(self, routes):
        nested = read_dcp(self.path, [self.keys[r] for r in routes], metadata=self.metadata, checked=self.checked)
        if self.titan is not None:
            return {r: value_at(nested, self.stored[r]) for r in routes}
        return {r: value_at(nested, r) for r in routes}

    def read(self) -> dict:
        """The whole checkpoint as a nested dict in flashdist's layout (full CPU tensors)."""
        got = self.get(list(self.specs))
        out = copy.deepcopy(self.rest)
        for route, tensor in got.items():
            _set(out, route, tensor)
        return out


class _TorchSource(Source):
    # torch.load(mmap=True) maps the file without reading it; each get maps it afresh and copies its tensors out,
    # so the pages it touched are unmapped when the copies are returned
    def __init__(self, path: Path):
        self.path = path
        state = self._load()
        check_nesting(state, path)
        tensors, rest = flat_tensors(state)
        super().__init__(rest, {r: (tuple(t.shape), t.dtype) for r, t in tensors.items()})

    def _load(self):
        check_torch_file(self.path)
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - truncated zip, refused pickle global, ...
            raise CheckpointError(f"flashdist: could not read {self.path}: {_first_line(e)}") from None

    def get(self, routes):
        state = self._load()
        return {r: value_at(state, r).clone() for r in routes}

    def shared(self, a, b):  # torch.save keeps one storage for a tensor saved under two names
        state = self._load()
        return _one_tensor(value_at(state, a), value_at(state, b))


class _SafetensorsSource(Source):
    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        check_safetensors_file(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                rest, routes = _safetensors_routes(path, f)
                self.keys, specs = {}, {}
                for key, route in routes.items():
                    sl = f.get_slice(key)
                    self.keys[route] = key
                    specs[route] = (tuple(sl.get_shape()), _dtype_of(sl.get_dtype()))
                    _set(rest, route, None)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"flashdist: could not read {path}: {_first_line(e)}") from None
        super().__init__(rest, specs)

    def get(self, routes):
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:  # mapped for this read only
            return {r: f.get_tensor(self.keys[r]).clone() for r in routes}


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


def _dtype_of(name: str) -> torch.dtype:
    from .output import SAFETENSORS_DTYPES

    for dtype, code in SAFETENSORS_DTYPES.items():
        if code == name:
            return dtype
    raise CheckpointError(f"flashdist: safetensors dtype {name} is not supported")


def value_at(nested, route):
    """The value at ``route`` (keys and list indices, outermost first) in a nested checkpoint dict."""
    for part in route:
        nested = nested[part]
    return nested


def open_source(path: str | os.PathLike, *, tag: str | None = None, master_weight_bits: int | None = None,
                progress: Progress = quiet, structure: bool = False) -> Source:
    """``path`` (any KIND) opened for streaming (see :class:`Source`). ``structure``: only ``rest`` and
    ``specs`` are wanted (``inspect``), and ``get`` of a step count: a DeepSpeed folder or a flashoptim file is
    then read as meta tensors (:func:`read` with ``structure``), its memory independent of its tensors'."""
    kind = detect(path)
    if kind == "dcp":
        _check_options(path, kind, tag, master_weight_bits)
        return _DcpSource(path)
    if kind == "torch":
        _check_options(path, kind, tag, master_weight_bits)
        try:
            return _TorchSource(Path(path))
        except CheckpointError:  # e.g. a file of torch's legacy format, which cannot be mapped: read it whole
            return MemorySource(read(path))
    if kind == "safetensors":
        _check_options(path, kind, tag, master_weight_bits)
        return _SafetensorsSource(Path(path))
    if kind == "trainer":
        _check_options(path, kind, tag, master_weight_bits)
        from .trainer_files import TrainerSource

        return TrainerSource(path)
    return MemorySource(read(path, tag=tag, master_weight_bits=master_weight_bits, progress=progress,
                             structure=structure))


class Fetcher:
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


# ----- the plain data of a safetensors file ---------------------------------------------------------------


def json_header(rest, dst) -> str:
    """The plain data of a checkpoint as JSON (safetensors keeps it in its header); torch dtypes as their names.
    Read back by this module's safetensors readers. Raises :class:`CheckpointError` naming ``dst`` (the file
    being written) when the data is not JSON."""
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
