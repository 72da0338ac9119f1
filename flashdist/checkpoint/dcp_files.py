"""DCP files read safely, and shard files tied to the save that wrote them.

- Safe: DCP reads its ``.metadata`` with plain ``pickle`` and non-tensor entries with
  ``torch.load(weights_only=False)``, either of which runs code from a crafted file.
  :class:`SafeFileSystemReader` reads the metadata with an unpickler that only builds DCP's own metadata
  classes, torch dtypes and sizes, and :class:`SafeLoadPlanner` reads non-tensor entries with
  ``weights_only=True``.
- Shards tied to their ``.metadata``: every shard file that :class:`TiedWriter` writes starts with the save's
  id (the ``save_id`` DCP records in ``.metadata``) and ends with the CRC-32 of its bytes, computed while
  writing. The safe reader refuses a shard of another save or a damaged one (:func:`verify_shard`), naming
  the file. Checkpoints written before shards carried an id load as before, unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError

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

SAVE_ID_PREFIX = "flashdist-1-"  # a .metadata save_id without it: a checkpoint written before shards had ids
_SHARD_MAGIC = b"flashdist shard\n"
SHARD_MAGIC = _SHARD_MAGIC  # how a shard file that save wrote starts (flashdist.checkpoint.ownership)
_HEADER_SIZE = len(_SHARD_MAGIC) + len(SAVE_ID_PREFIX) + 32
_TRAILER = struct.Struct("<8sQI")  # magic, length of everything before the trailer, CRC-32 of it
_TRAILER_MAGIC = b"fdshard\n"
_CHUNK = 16 << 20
_FULL_CHECK = "flashdist: shards whose CRC this rank checks"  # key in a LoadPlan's storage_data


def _save_id_of(metadata: Metadata) -> str | None:
    storage_meta = getattr(metadata, "storage_meta", None)
    save_id = getattr(storage_meta, "save_id", None)
    return save_id if isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX) else None


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
            magic, length, written = _TRAILER.unpack(f.read(_TRAILER.size))
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
    if left or actual != written:
        raise CheckpointError(f"flashdist: shard {file} is damaged (CRC-32 {actual:08x}, written {written:08x})")


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


class TiedWriter(FileSystemWriter):
    """FileSystemWriter whose shards carry ``save_id`` (also recorded in ``.metadata``) and a CRC-32; ``save``
    writes each checkpoint through one, under the id it agreed on with every rank."""

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
    return TiedWriter(Path(path), new_save_id())


def new_save_id() -> str:
    """A fresh save id: :data:`SAVE_ID_PREFIX` and 32 hex digits (a checkpoint's temporary folder is named
    after them)."""
    return SAVE_ID_PREFIX + uuid.uuid4().hex

