"""``save`` / ``load``: a thin, safe layer over torch.distributed.checkpoint (DCP) for model + optimizer.

- Atomic: ``save`` writes into a temporary folder of its own, ``PATH.tmp-<id>`` (a fresh id per save, agreed
  by all ranks), and once every rank has finished moves it into place (``PATH`` -> ``PATH.old``,
  ``PATH.tmp-<id>`` -> ``PATH``, then ``PATH.old`` is removed). A job killed at any moment leaves the last
  good checkpoint loadable: ``load`` falls back to ``PATH.old`` in the instant between the two renames.
- Concurrent saves never mix: each writes its own folder, and the renames happen under an exclusive
  ``flock`` on ``PATH.flashdist-lock``, so the last save to finish wins whole. A crashed save's folder is recognised
  (its writer's lock is gone) and removed by a later save; ``load`` never looks at it.
- Never destroys what it did not write: a regular file at ``PATH``, a symbolic link, or a folder holding
  anything but DCP files is refused before anything is written.
- Shards tied to their ``.metadata``: every shard file starts with the save's id (the ``save_id`` DCP
  records in ``.metadata``) and ends with the CRC-32 of its bytes, computed while writing. ``load`` refuses a
  shard of another save or a damaged one, naming the file. Checkpoints written before shards carried an id
  load as before, unchecked.
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
- One error: a failed save raises :class:`CheckpointWriteError` (an ``OSError`` and a
  :class:`CheckpointError`) naming the path and the cause, after removing only its own temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
import pickle
import re
import shutil
import struct
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: saves are not serialised (docs/checkpoints.md)
    fcntl = None  # type: ignore[assignment]

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..quant.moment import QuantizedMoment
from ..optim.base import FlashOptimizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model and optimizer (nothing was changed), or a save
    refused before it wrote anything."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save that failed while writing (read-only folder, full disk, I/O error): the checkpoint at the path,
    if any, is unchanged and this save's temporary folder was removed."""


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
    """FileSystemReader whose metadata load cannot run code, and which refuses a shard file of another save
    or a damaged one (:func:`verify_shard`) before reading from it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"flashdist: {self.path} is not a DCP checkpoint (no .metadata file)") from None
        except OSError as e:
            raise CheckpointError(f"flashdist: cannot read {path}: {e.strerror or e}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"flashdist: {path} is not a valid DCP metadata file ({e}); the checkpoint "
                                  "is damaged or was not written by torch.distributed.checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"flashdist: {path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._save_id = _save_id_of(metadata)

    def prepare_global_plan(self, plans):
        # The CRC of each shard file is checked by ONE rank that reads the file (the one with the fewest
        # bytes to check so far), so a load reads the checkpoint once more in all, not once per rank;
        # every rank still checks the save id of each file it reads.
        plans = super().prepare_global_plan(plans)
        load = [0] * len(plans)
        owner: dict[str, int] = {}
        for rank, plan in enumerate(plans):
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                if name not in owner or load[rank] < load[owner[name]]:
                    if name in owner:
                        load[owner[name]] -= self._size(name)
                    owner[name] = rank
                    load[rank] += self._size(name)
        return [dataclasses.replace(plan, storage_data={_FULL_CHECK: sorted(n for n, r in owner.items() if r == rank)})
                if plan.storage_data is None else plan for rank, plan in enumerate(plans)]

    def _size(self, name: str) -> int:
        try:
            return os.path.getsize(Path(self.path) / name)
        except OSError:
            return 0

    def read_data(self, plan, planner):
        # every shard this rank reads is checked first; an error here reaches every rank through DCP's
        # gather of read results, so no rank goes on alone
        full = plan.storage_data.get(_FULL_CHECK) if isinstance(plan.storage_data, dict) else None
        files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        for name in files:
            verify_shard(Path(self.path) / name, self._save_id, crc=full is None or name in full)
        return super().read_data(plan, planner)


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


# ----- shards tied to their .metadata ---------------------------------------------------------------------
# A shard file written by save() is   header | DCP's own bytes | trailer.   DCP records absolute offsets
# (stream.tell()), so any DCP reader, torch's own included, still finds every entry.

_SAVE_ID_PREFIX = "flashdist-1-"  # a .metadata save_id without it: a checkpoint written before shards had ids
_SHARD_MAGIC = b"flashdist shard\n"
_HEADER_SIZE = len(_SHARD_MAGIC) + len(_SAVE_ID_PREFIX) + 32
_TRAILER = struct.Struct("<8sQI")  # magic, length of everything before the trailer, CRC-32 of it
_TRAILER_MAGIC = b"fdshard\n"
_CHUNK = 16 << 20
_FULL_CHECK = "flashdist: shards whose CRC this rank checks"  # key in a LoadPlan's storage_data


def _save_id_of(metadata: Metadata) -> str | None:
    storage_meta = getattr(metadata, "storage_meta", None)
    save_id = getattr(storage_meta, "save_id", None)
    return save_id if isinstance(save_id, str) and save_id.startswith(_SAVE_ID_PREFIX) else None


def verify_shard(file: str | os.PathLike, save_id: str | None, *, crc: bool = True) -> None:
    """Raise :class:`CheckpointError` naming ``file`` unless it is an intact shard of the save ``save_id``
    (the id in its checkpoint's ``.metadata``; None for a checkpoint written before shards carried ids, whose
    shards cannot be checked but must not be shards of a newer save either). With ``crc`` it reads the whole
    file once to check its CRC-32; without, only its first and last bytes (id, length)."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            head = f.read(_HEADER_SIZE)
            tied = head.startswith(_SHARD_MAGIC)
            if save_id is None:
                if tied:
                    raise CheckpointError(f"flashdist: shard {file} was written by save "
                                          f"{head[len(_SHARD_MAGIC):].decode(errors='replace')}, but the checkpoint's "
                                          ".metadata predates shard ids: the folder mixes files of two saves")
                return
            if head != _SHARD_MAGIC + save_id.encode():
                found = head[len(_SHARD_MAGIC):].decode(errors="replace") if tied else "no flashdist save id"
                raise CheckpointError(f"flashdist: shard {file} belongs to another save ({found}) than its "
                                      f"checkpoint's .metadata ({save_id}): the folder mixes files of two saves; "
                                      "restore the original file or load another checkpoint")
            size = os.fstat(f.fileno()).st_size
            body = size - _TRAILER.size
            if body < _HEADER_SIZE:
                raise CheckpointError(f"flashdist: shard {file} is truncated ({size} bytes)")
            f.seek(body)
            magic, length, crc = _TRAILER.unpack(f.read(_TRAILER.size))
            if magic != _TRAILER_MAGIC or length != body:
                raise CheckpointError(f"flashdist: shard {file} is truncated or damaged (its end marker is missing)")
            if not crc:
                return
            f.seek(0)
            actual, left = 0, body
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                actual = zlib.crc32(chunk, actual)
                left -= len(chunk)
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot read shard {file}: {e.strerror or e}") from None
    if left or actual != crc:
        raise CheckpointError(f"flashdist: shard {file} is damaged (CRC-32 {actual:08x}, written {crc:08x})")


class _ShardStream(io.IOBase):
    """Writes the header, passes DCP's bytes through while updating their CRC-32, and on a clean close
    appends the trailer and syncs it (DCP synced its own bytes already)."""

    def __init__(self, raw, save_id: str):
        self._raw, self._crc, self._length = raw, 0, 0
        self.write(_SHARD_MAGIC + save_id.encode())

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self._raw.write(b)
        self._crc = zlib.crc32(b, self._crc)
        self._length += n
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def finish(self) -> None:
        if not self._raw.closed:
            self._raw.write(_TRAILER.pack(_TRAILER_MAGIC, self._length, self._crc))
            self._raw.flush()
            os.fsync(self._raw.fileno())

    def close(self) -> None:  # DCP closes the stream itself; the trailer is written by finish() only
        self.flush()
        super().close()


class _TiedFileSystem(FileSystem):
    def __init__(self, save_id: str):
        self._save_id = save_id

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as raw:
            stream = _ShardStream(raw, self._save_id)
            yield stream
            stream.finish()  # not reached when writing failed: a half-written shard gets no end marker


class _TiedWriter(FileSystemWriter):
    """FileSystemWriter whose shards carry ``save_id`` (also recorded in ``.metadata``) and a CRC-32."""

    def __init__(self, path: Path, save_id: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self.fs = _TiedFileSystem(save_id)
        self._tied_save_id = save_id

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._tied_save_id)


def shard_writer(path: str | os.PathLike) -> FileSystemWriter:
    """A DCP storage writer for a new checkpoint folder ``path`` whose shards are tied to its ``.metadata``
    (a fresh save id in each shard and in the metadata, a CRC-32 per shard), as ``save`` writes them; for
    writers of whole checkpoints other than ``save`` (``flashdist convert --to dcp``)."""
    return _TiedWriter(Path(path), _SAVE_ID_PREFIX + uuid.uuid4().hex)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _state(model, optimizer, extra, optimizer_format: str | None = None) -> dict:
    return {"model": get_model_state_dict(model),
            "optim": optimizer_state_dict(model, optimizer, format=optimizer_format),
            "extra": extra if extra is not None else {}}


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         format: str | None = None) -> dict:
    """torch.distributed.checkpoint's ``get_optimizer_state_dict(model, optimizer)`` (state keyed by
    parameter FQN, DTensors kept), with a flashdist optimizer's state in ``format`` ("portable" or
    "compressed"; None: the optimizer's ``state_dict_format``). The optimizer's setting is left as it is.
    Any other optimizer: its state dict as torch gives it (``format`` must then be None)."""
    if not isinstance(optimizer, FlashOptimizer):
        if format is not None:
            raise ValueError(f"flashdist: optimizer_state_dict's format applies to flashdist optimizers; "
                             f"{type(optimizer).__name__} has one format: pass format=None")
        return get_optimizer_state_dict(model, optimizer)
    with optimizer.state_dict_format_override(format or optimizer.state_dict_format):
        return get_optimizer_state_dict(model, optimizer)


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict | None = None) -> Path:
    """Save model, optimizer and ``extra`` (plain data: numbers, strings, lists, dicts, tensors) to the DCP
    directory ``path``, atomically. Every rank calls it. Returns the path.

    ``path`` must not exist, be an empty folder or hold a checkpoint (DCP files only); anything else raises
    :class:`CheckpointError` before a byte is written. A failure while writing raises
    :class:`CheckpointWriteError` on every rank, naming the path and the cause."""
    path = Path(path)
    claim, message = None, None
    if _rank() == 0:
        try:
            claim = _Claim(path)
        except CheckpointError as e:
            message = (type(e).__name__, str(e))
    # all ranks write into the folder rank 0 created, under the id rank 0 drew
    save_id, message = _from_rank0((claim.save_id if claim else None, message))
    if message:
        _raise(message)
    tmp = _temp_folder(path, save_id)
    try:
        failure = None
        try:
            dcp.save(_state(model, optimizer, extra), storage_writer=_TiedWriter(tmp, save_id))
        except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures in a BaseException
            failure = f"flashdist: could not save checkpoint {path}: {error_summary(e)}"
        failures = _gather(failure)
        message = None
        if any(failures):
            message = ("CheckpointWriteError", next(f for f in failures if f) + f"; {path} was not changed")
        elif claim is not None:
            try:
                claim.commit()
            except CheckpointError as e:
                message = (type(e).__name__, str(e))
    finally:
        if claim is not None:
            claim.release()  # removes the temporary folder unless it became the checkpoint
    message = _from_rank0(message)
    if message:
        _raise(message)
    return path


def _raise(message: tuple[str, str]):
    kind, text = message
    raise (CheckpointWriteError if kind == "CheckpointWriteError" else CheckpointError)(text)


def _from_rank0(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


_LOCK_SUFFIX = ".flashdist-lock"  # a name no user file is likely to have: the lock file is removed after use
_WRITING = ".flashdist-writing"  # held (flock) by a live save in its temporary folder; removed at the commit
_DCP_NAME = re.compile(r"(__\d+)?\.metadata(\.tmp)?|.*\.distcp")  # what DCP's FileSystemWriter writes
_warned_no_flock = False


def _temp_folder(path: Path, save_id: str) -> Path:
    return path.with_name(f"{path.name}.tmp-{save_id.removeprefix(_SAVE_ID_PREFIX)}")


def _foreign_files(folder: Path) -> list[str]:
    """Names in ``folder`` that DCP does not write (sorted); ``folder`` must be a directory."""
    return sorted(n for n in os.listdir(folder) if not _DCP_NAME.fullmatch(n) and n != _WRITING)


def _check_target(path: Path) -> None:
    """Refuse a ``path`` (or a leftover ``PATH.old``) that a save would replace but that holds something a
    save did not write. Rank 0, before writing and again under the lock before the renames."""
    for target in (path, path.with_name(path.name + ".old")):
        what = "" if target == path else f" (left by an earlier save to {path.name}?)"
        if target.is_symlink():
            raise CheckpointError(f"flashdist: {target} is a symbolic link{what}; save to the folder it points to, "
                                  "or remove the link")
        if not target.exists():
            continue
        if not target.is_dir():
            raise CheckpointError(f"flashdist: {target} exists and is not a folder{what}; a checkpoint is a folder "
                                  "and saving would delete that file: choose another path or move the file")
        try:
            foreign = _foreign_files(target)
        except OSError as e:
            raise CheckpointWriteError(f"flashdist: cannot save checkpoint to {path}: cannot list {target}: "
                                       f"{e.strerror or e}") from None
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise CheckpointError(f"flashdist: {target} is a folder holding files that are not part of a checkpoint "
                                  f"({shown}){what}; saving would delete them: choose another path or move them")


def _flock(fd: int, flags: int) -> bool | None:
    """flock(fd, flags): True when locked, False when another holder has it (LOCK_NB), None when this file
    system cannot lock (then saves to one path are not serialised: docs/checkpoints.md)."""
    global _warned_no_flock
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, flags)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if not _warned_no_flock:
            warnings.warn(f"flashdist: this file system cannot lock files ({e.strerror}); concurrent saves to one "
                          "checkpoint path are not serialised", stacklevel=3)
            _warned_no_flock = True
        return None


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive flock on ``lock`` (created if missing, removed on release). A process that dies
    holding it releases it, so a crashed save never blocks a later one."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        if _flock(fd, fcntl.LOCK_EX if fcntl else 0) is None:
            break
        # the previous holder removes the file on release: a lock on a removed file guards nothing, retry
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _remove_dead_temps(path: Path) -> None:
    """Remove the temporary folders of saves to ``path`` whose writer died (its lock file is no longer held);
    leave those of live saves, and any folder holding files a save did not write."""
    pattern = re.compile(re.escape(path.name) + r"\.tmp-[0-9a-f]{32}")
    for folder in path.parent.iterdir():
        if not pattern.fullmatch(folder.name) or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            fd = os.open(folder / _WRITING, os.O_RDWR)
        except OSError:
            continue  # being created or being committed right now, or not ours
        try:
            if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if fcntl else 0) and not _foreign_files(folder):
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


class _Claim:
    """Rank 0's side of one save: the checks, the temporary folder and its lock, the renames."""

    def __init__(self, path: Path):
        self.path = path
        self.save_id = _SAVE_ID_PREFIX + uuid.uuid4().hex
        self.tmp = _temp_folder(path, self.save_id)
        self.fd: int | None = None
        self.committed = False
        _check_target(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_dead_temps(path)
            self.tmp.mkdir()
            # lock the writer's file before it gets its name, so no cleaner ever sees it unlocked
            fresh = self.tmp / (_WRITING + ".new")
            self.fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            _flock(self.fd, fcntl.LOCK_EX if fcntl else 0)
            os.replace(fresh, self.tmp / _WRITING)
        except OSError as e:
            self.release()
            raise CheckpointWriteError(f"flashdist: cannot save checkpoint to {path}: {e.strerror or e}"
                                       + (f" ({e.filename})" if e.filename else "") + "; nothing was written") from None

    def commit(self) -> None:
        path, old = self.path, self.path.with_name(self.path.name + ".old")
        try:
            with _exclusive(path.with_name(path.name + _LOCK_SUFFIX)):
                _check_target(path)  # anything may have appeared at the path while the shards were written
                os.unlink(self.tmp / _WRITING)
                moved = path.exists()
                if moved:  # PATH.old, if any, is older than PATH
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(path, old)
                try:
                    os.replace(self.tmp, path)
                except OSError:
                    if moved:
                        os.replace(old, path)
                    raise
                self.committed = True
                _fsync_dir(path.parent)
                shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            raise CheckpointWriteError(f"flashdist: could not move the checkpoint into place at {path}: "
                                       f"{e.strerror or e}; the previous checkpoint there (if any) is unchanged"
                                       ) from None

    def release(self) -> None:
        if not self.committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
    or the shard file that belongs to another save or is damaged, with the model and optimizer unchanged."""
    where = resolve(path)
    reader = SafeFileSystemReader(str(where))
    metadata = reader.read_metadata()
    # Read the optimizer state in the format it was saved in, whatever this optimizer saves:
    # load_state_dict takes both
    fmt = (_saved_format(metadata) or "portable") if isinstance(optimizer, FlashOptimizer) else None
    state = _clone(_state(model, optimizer, None, fmt))
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
        raise CheckpointError(f"flashdist: could not read checkpoint {where}: {error_summary(e)}; the model and "
                              "optimizer were not changed") from e
    set_optimizer_state_dict(model, optimizer, state["optim"])  # validates everything before it copies
    set_model_state_dict(model, state["model"])
    return state["extra"]


def _saved_format(metadata) -> str | None:
    """"compressed" when the checkpoint's optimizer state holds codes, "portable" when it holds float
    moments only, None when it holds neither (no quantized parameter: the two formats are the same)."""
    keys = [k for k in metadata.state_dict_metadata if k.startswith("optim.state.")]
    if QuantizedMoment.any_codes(keys):
        return "compressed"
    return None


_OPTIMIZERS_BY_MOMENTS = {("exp_avg", "exp_avg_sq"): "FlashAdamW/FlashAdam", ("exp_avg",): "FlashLion",
                          ("momentum_buffer",): "FlashSGD/FlashSGDW with momentum", (): "FlashSGD without momentum"}


def _optimizer_hint(have, want) -> str:
    """Why the optimizer-state keys differ, when that is the reason: another optimizer, the other state-dict
    format, or rho on one side only. Empty when the state keys agree."""
    def state_keys(keys):  # the last part of optim.state.<fqn>.<key>
        return {k.rsplit(".", 1)[-1] for k in keys if k.startswith("optim.state.")}

    def moments(keys):
        return tuple(sorted({QuantizedMoment.split_key(k)[0] for k in keys} - {"step", "rho"}))

    def fmt(keys):
        return "compressed" if QuantizedMoment.any_codes(keys) else "portable"

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


def error_summary(e: BaseException) -> str:
    """One line for an error met while reading or writing a checkpoint: DCP's first failing rank's own error
    rather than its traceback dump; flashdist's own message whole, anything else's first line (at most 300
    characters); without a leading ``flashdist: `` (the caller adds its own)."""
    if isinstance(e, CheckpointException):  # the first rank's own error, not DCP's traceback dump
        failures = [e.failures[rank] for rank in sorted(e.failures)]
        if failures:
            e = failures[0]
            if isinstance(e, tuple):  # DCP's WRAPPED_EXCEPTION: (exception, traceback summary)
                e = e[0]
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    if not text:
        return type(e).__name__
    return (text[0] if isinstance(e, CheckpointError) else text[0][:300]).removeprefix("flashdist: ")
