"""``save`` / ``load``: a thin, safe layer over torch.distributed.checkpoint (DCP) for model + optimizer.

- Atomic: ``save`` writes into ``PATH.tmp`` and, once every rank has finished, moves it into place
  (``PATH`` -> ``PATH.old``, ``PATH.tmp`` -> ``PATH``, then ``PATH.old`` is removed). A job killed at any
  moment leaves the last good checkpoint loadable: ``load`` falls back to ``PATH.old`` in the instant
  between the two renames.
- Safe: DCP reads its ``.metadata`` with plain ``pickle`` and non-tensor entries with
  ``torch.load(weights_only=False)``, either of which runs code from a crafted file. ``load`` reads the
  metadata with an unpickler that only builds DCP's own metadata classes, torch dtypes and sizes, and
  reads non-tensor entries with ``weights_only=True``.
- Checked before anything changes: missing or unexpected keys and shape mismatches raise an error naming
  the keys; a missing or truncated shard file raises an error naming the checkpoint. The model and the
  optimizer load from copies, so a failed load leaves them as they were (the cost: one extra copy of this
  rank's shard of the model and optimizer state during the load).
- Any world size: the model and the optimizer state are saved as DTensors with global shapes, so a
  checkpoint saved on N ranks loads on M (portable state re-quantizes, compressed state reshards exactly).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model and optimizer; nothing was changed."""


_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata dataclasses, torch dtypes/sizes/layouts and paths; refuses anything else."""

    def find_class(self, module: str, name: str):
        obj = None
        if module in _METADATA_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            obj = obj if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING" else None
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            obj = getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            obj = torch.serialization._get_layout
        elif module == "pathlib" and name in _PATH_CLASSES:
            obj = getattr(__import__("pathlib"), name)
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")
        return obj


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata load cannot run code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"flashdist: {self.path} is not a DCP checkpoint (no .metadata file)") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"flashdist: {path} is not a valid DCP metadata file ({e}); the checkpoint "
                                  "is damaged or was not written by torch.distributed.checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"flashdist: {path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"flashdist: checkpoint entry '{read_item.dest_index.fqn}' is not plain data "
                                  f"and was refused (weights_only=True): {e}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _state(model, optimizer, extra) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
            "extra": extra if extra is not None else {}}


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict | None = None) -> Path:
    """Save model, optimizer and ``extra`` (plain data: numbers, strings, lists, dicts, tensors) to the DCP
    directory ``path``, atomically. Every rank calls it. Returns the path."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(_state(model, optimizer, extra), checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(path.parent)
    _barrier()
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | os.PathLike) -> Path:
    """The directory to load: ``path``, or ``path.old`` if a save was interrupted between its renames."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    old = path.with_name(path.name + ".old")
    if not path.exists() and (old / ".metadata").exists():
        return old
    if not path.exists():
        raise CheckpointError(f"flashdist: no checkpoint at {path}")
    raise CheckpointError(f"flashdist: {path} is not a DCP checkpoint (no .metadata file)")


def read_metadata(path: str | os.PathLike) -> Metadata:
    return SafeFileSystemReader(str(resolve(path))).read_metadata()


def _template_for_extra(metadata: Metadata) -> dict:
    """A state-dict skeleton for the saved ``extra`` entries, rebuilt from the checkpoint's metadata."""
    extra: dict = {}
    mappings = metadata.planner_data or {}
    for key, meta in metadata.state_dict_metadata.items():
        route = mappings.get(key, tuple(key.split(".")))
        if not route or route[0] != "extra":
            continue
        value = None if isinstance(meta, BytesStorageMetadata) else torch.empty(meta.size, dtype=meta.properties.dtype)
        node = extra
        for part in route[1:-1]:
            node = node.setdefault(part, {})
        if len(route) > 1:
            node[route[-1]] = value
    return extra


def _flat_shapes(state: dict) -> dict[str, tuple]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    flat, _ = flatten_state_dict(state)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def _clone(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint written by :func:`save` (at any world size) into ``model`` and ``optimizer``; returns
    the saved ``extra``. Every rank calls it. Raises :class:`CheckpointError` naming what does not match,
    with the model and optimizer unchanged."""
    where = resolve(path)
    reader = SafeFileSystemReader(str(where))
    metadata = reader.read_metadata()
    # Read the optimizer state in the format it was saved in, whatever this optimizer saves:
    # load_state_dict takes both
    with _state_dict_format(optimizer, _saved_format(metadata)):
        state = _clone(_state(model, optimizer, None))
    state["extra"] = _template_for_extra(metadata)
    want = {k: v for k, v in _flat_shapes(state).items() if not k.startswith("extra.")}
    have = {k: getattr(m, "size", None) for k, m in metadata.state_dict_metadata.items() if not k.startswith("extra.")}
    missing = sorted(k for k in want if k not in have)
    unexpected = sorted(k for k in have if k not in want)
    wrong = sorted(k for k, shape in want.items() if k in have and shape is not None and have[k] is not None
                   and tuple(have[k]) != shape)
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            details.append(f"not in this model/optimizer: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if wrong:
            details.append("other shapes: " + ", ".join(f"{k} {tuple(have[k])} vs {want[k]}" for k in wrong[:8]))
        hint = _optimizer_hint(have, want)
        if hint:
            details.insert(0, hint)
        raise CheckpointError(f"flashdist: checkpoint {where} does not match this model and optimizer: "
                              + "; ".join(details))
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures in a BaseException
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {_short(e)}; the model and "
                              "optimizer were not changed") from e
    set_optimizer_state_dict(model, optimizer, state["optim"])  # validates everything before it copies
    set_model_state_dict(model, state["model"])
    return state["extra"]


def _saved_format(metadata) -> str | None:
    """"compressed" when the checkpoint's optimizer state holds codes, "portable" when it holds float
    moments only, None when it holds neither (no quantized parameter: the two formats are the same)."""
    keys = [k for k in metadata.state_dict_metadata if k.startswith("optim.state.")]
    if any(k.endswith("_codes") for k in keys):
        return "compressed"
    return None


@contextlib.contextmanager
def _state_dict_format(optimizer, fmt: str | None):
    """A flashdist optimizer's state_dict() in format ``fmt`` inside the block (portable when None)."""
    old = getattr(optimizer, "state_dict_format", None)
    if old is None:  # not a flashdist optimizer
        yield
        return
    optimizer.state_dict_format = fmt or "portable"
    try:
        yield
    finally:
        optimizer.state_dict_format = old


_OPTIMIZERS_BY_MOMENTS = {("exp_avg", "exp_avg_sq"): "FlashAdamW/FlashAdam", ("exp_avg",): "FlashLion",
                          ("momentum_buffer",): "FlashSGD/FlashSGDW with momentum", (): "FlashSGD without momentum"}


def _optimizer_hint(have, want) -> str:
    """Why the optimizer-state keys differ, when that is the reason: another optimizer, the other state-dict
    format, or rho on one side only. Empty when the state keys agree."""
    def state_keys(keys):  # the last part of optim.state.<fqn>.<key>
        return {k.rsplit(".", 1)[-1] for k in keys if k.startswith("optim.state.")}

    def moments(keys):
        return tuple(sorted({k.removesuffix("_codes").removesuffix("_scales") for k in keys} - {"step", "rho"}))

    def fmt(keys):
        return "compressed" if any(k.endswith("_codes") for k in keys) else "portable"

    saved, mine = state_keys(have), state_keys(want)
    if saved == mine or not saved or not mine:
        return ""
    if moments(saved) != moments(mine):
        a, b = moments(saved), moments(mine)
        return (f"the checkpoint's optimizer state holds {list(a) or 'no moments'} "
                f"({_OPTIMIZERS_BY_MOMENTS.get(a, 'another optimizer')}), this optimizer's {list(b) or 'none'} "
                f"({_OPTIMIZERS_BY_MOMENTS.get(b, 'another optimizer')}): build the optimizer the checkpoint was saved "
                "with")
    if fmt(saved) != fmt(mine):  # load() reads either format: only 8-bit codes against fp32 moments get here
        return ("the checkpoint's optimizer state is compressed (8-bit codes), this optimizer keeps fp32 moments "
                "(quantize_states=False): build it with quantize_states=True, or `flashdist convert --format "
                "portable` the checkpoint")
    if ("rho" in saved) != ("rho" in mine):
        return (f"the checkpoint's optimizer state {'has' if 'rho' in saved else 'has no'} rho, this optimizer "
                f"{'keeps' if 'rho' in mine else 'keeps no'} rho: build it with the master_weight_bits and parameter "
                "dtype the checkpoint was saved with")
    return ""


def _short(e: BaseException) -> str:
    if isinstance(e, CheckpointException):  # the first rank's own error, not DCP's traceback dump
        failures = list(e.failures.values())
        if failures:
            e = failures[0]
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    return text[0][:300] if text else type(e).__name__
