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
import math
import os
import pickle
import pickletools
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as _ShardedTensorProperties
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from .errors import CheckpointError
from .files import (check_nesting, check_routes, check_torch_stream, inside, metadata_budget, open_regular, over_budget, printable,
                    read_bounded, reason, regular_size, shown)

def max_metadata_bytes() -> int:
    """The largest ``.metadata`` file read: a twentieth of the metadata budget (:func:`check_pickle` bounds the
    cost of unpickling it, about 45 times the size of a real one; the unpickled objects take about 13)."""
    return metadata_budget() // 20

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_SHARDED_METADATA = "torch.distributed._shard.sharded_tensor.metadata"
# What dcp.save pickles into .metadata (torch 2.13; older versions wrote the TensorProperties of the
# sharded-tensor module): DCP's metadata dataclasses (built field by field, their __init__ sets attributes
# only), the enum TensorProperties encodes the memory format with, the storage record of FileSystemWriter,
# sizes, dtypes, layouts (torch.serialization._get_layout looks a name up in a table) and the checkpoint_id
# path. Nothing here touches the file system or allocates from the file's numbers.
_ALLOWED = {
    (_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                       "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                       "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {(_SHARDED_METADATA, "TensorProperties"), (_SHARDED_METADATA, "MEM_FORMAT_ENCODING"),
     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
     ("pathlib._local", "PurePosixPath")}


# Opcodes dcp.save never writes and whose objects DCP metadata never holds (sets: the object built per byte of
# file is largest for them; buffers, persistent ids and extension codes: not plain data).
_REFUSED_OPCODES = frozenset({"EMPTY_SET", "ADDITEMS", "FROZENSET", "BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER",
                              "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"})
_PUT_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})

# An upper bound of the memory (bytes, CPython 3.10-3.13, 64-bit) the C unpickler spends per opcode, so that
# the sum over a file bounds its peak: every opcode may take a stack slot, a memo slot and a mark slot, each
# in an array that grows by doubling (_OPCODE); what each opcode builds (_BUILT, plus _PER_BYTE times its
# length for strings and numbers); and each item it puts into a container (_PER_ITEM; a dict item is counted
# twice: BUILD may copy a state dict into the instance's own).
_OPCODE = 16
_BUILT = {"EMPTY_LIST": 96, "LIST": 96, "EMPTY_DICT": 96, "DICT": 96, "TUPLE": 80, "TUPLE1": 80, "TUPLE2": 80,
          "TUPLE3": 80, "REDUCE": 96, "NEWOBJ": 96, "NEWOBJ_EX": 96, "OBJ": 96, "INST": 96, "BUILD": 256,
          "BINFLOAT": 32, "FLOAT": 32, "MARK": 16, "MEMOIZE": 16, "PUT": 16, "BINPUT": 16, "LONG_BINPUT": 16}
_PER_BYTE = {**dict.fromkeys(("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"), (64, 4)),
             **dict.fromkeys(("SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "SHORT_BINSTRING", "BINSTRING", "STRING"),
                             (48, 1)),
             **dict.fromkeys(("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"), (32, 1))}
_PER_ITEM = {**dict.fromkeys(("APPEND", "APPENDS", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"), 16),
             **dict.fromkeys(("SETITEM", "SETITEMS", "DICT"), 128)}
_ITEMS = {"SETITEM": 2, "APPEND": 1, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}  # fixed item counts (others: to the mark)


def check_pickle(data: bytes, path: Path) -> int:
    """Walk the pickle's opcodes before it is unpickled and return an upper bound of the memory unpickling it
    takes; refuse opcodes metadata never holds, and memo indexes beyond the objects built so far (the C
    unpickler grows its memo table to twice the index it is given, so a 10-byte file could make it set
    gigabytes aside)."""
    def invalid(what: str) -> CheckpointError:
        return CheckpointError(f"flashdist: {path} is not a valid DCP metadata file ({what}); the checkpoint is "
                               "damaged or was not written by torch.distributed.checkpoint")

    cost, depth, marks, last = 0, 0, [], None
    try:
        for count, (op, arg, pos) in enumerate(pickletools.genops(data)):
            name = op.name
            if name in _REFUSED_OPCODES or (name in _PUT_OPCODES and not 0 <= int(arg) <= count):
                raise CheckpointError(f"flashdist: {path} is not a valid DCP metadata file (it holds the pickle "
                                      f"opcode {name} {shown(arg)}, which DCP metadata does not); the checkpoint "
                                      "is damaged or crafted")
            if last is not None:  # the previous opcode's length is known now
                cost += last[1] * (pos - last[0])
            before, after = op.stack_before, op.stack_after
            if name == "MARK":
                marks.append(depth)
                items = 0
            elif pickletools.stackslice in before:
                if not marks:
                    raise invalid(f"opcode {name} at byte {pos} without a mark")
                mark = marks.pop()
                items = depth - mark
                depth = mark - before.index(pickletools.markobject) + len(after)  # what lay below the mark goes
            else:
                items = _ITEMS.get(name, 0)
                depth += len(after) - len(before)
            if depth < 0:
                raise invalid(f"opcode {name} at byte {pos} on an empty stack")
            base, per_byte = _PER_BYTE.get(name, (0, 0))
            cost += _OPCODE + _BUILT.get(name, 0) + base + _PER_ITEM.get(name, 0) * items
            last = (pos, per_byte)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or unknown opcodes
        raise invalid(reason(e)) from None
    return cost


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP metadata holds (:data:`_ALLOWED`, and torch dtypes); refuses anything else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module[:60]}.{name[:60]} from checkpoint metadata")


class _ConfinedFileSystem(FileSystem):
    """DCP's file system for reading: the files a ``.metadata`` names resolve inside the checkpoint folder and
    are opened only when regular (:mod:`flashdist.checkpoint.files`)."""

    def concat_path(self, path, suffix):
        return inside(path, suffix, source=Path(path) / ".metadata")

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "rb":
            raise CheckpointError(f"flashdist: the checkpoint reader does not write ({path})")
        with open_regular(path) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata load cannot run code or build more than the checkpoint holds
    (:func:`check_metadata`), which reads only regular files inside the checkpoint folder
    (:mod:`flashdist.checkpoint.files`), and which refuses a shard file of another save or a damaged one
    (:func:`verify_shard`) before reading from it."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self.fs = _ConfinedFileSystem()
        self.path = Path(os.path.realpath(self.path))  # the folder the user named; links above it are theirs

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        if not os.path.lexists(path):
            raise CheckpointError(f"flashdist: {self.path} is not a DCP checkpoint (no .metadata file)")
        real = inside(self.path, ".metadata")
        size = regular_size(real, expected="a DCP metadata file")
        if size > max_metadata_bytes():  # too long even to walk: a real one costs 20 to 45 times its size
            raise over_budget(path, 20 * size, "its metadata")
        data = read_bounded(real, max_metadata_bytes(), expected="a DCP metadata file")
        cost = 2 * len(data) + check_pickle(data, path)  # the bytes, a frame read from them, the objects
        if cost > metadata_budget():
            raise over_budget(path, cost, "its metadata")
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as e:  # noqa: BLE001 - any damage (bit flips, truncation, crafted opcodes) is one line
            raise CheckpointError(f"flashdist: {path} is not a valid DCP metadata file ({reason(e)}); the checkpoint "
                                  "is damaged or was not written by torch.distributed.checkpoint") from None
        del data
        check_metadata(metadata, self.path)
        if metadata.storage_meta is not None:
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
        return regular_size(inside(self.path, name, source=Path(self.path) / ".metadata"))

    def _slice_file(self, file, sinfo):
        # each record is a torch.save stream: checked as a torch file (stored records inside it, its pickle
        # within the budget) before torch.load inflates it, tensors included (check_metadata bounds its length)
        check_torch_stream(_Window(file, sinfo.offset, sinfo.length), sinfo.length,
                           f"a record of {Path(self.path) / sinfo.relative_path}")
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        # every shard this rank reads is checked first; an error here reaches every rank through DCP's
        # gather of read results, so no rank goes on alone
        full = plan.storage_data.get(_FULL_CHECK) if isinstance(plan.storage_data, dict) else None
        files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        for name in files:
            verify_shard(inside(self.path, name, source=Path(self.path) / ".metadata"), self._save_id,
                         crc=full is None or name in full)
        return super().read_data(plan, planner)


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of a seekable binary file, as a file of their own (what
    :func:`check_torch_stream` reads a DCP record through: zipfile seeks from its end)."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.position))
        if not n:
            return 0
        self.file.seek(self.offset + self.position)
        got = self.file.readinto(memoryview(buffer)[:n])
        self.position += got
        return got


_TENSOR_PROPERTIES = (TensorProperties, _ShardedTensorProperties)
# what torch.save adds to a tensor's bytes in its record (its zip entries and pickle: about 1.6 KB), with room
# to spare: a longer record is not one DCP wrote, and reading it would cost more than the tensor
_RECORD_SLACK = 64 << 10


def check_metadata(metadata: Any, folder: str | os.PathLike) -> None:
    """Refuse (one line naming the ``.metadata`` file) metadata that does not describe a checkpoint this
    folder holds, before anything is allocated from its numbers: the types DCP writes; tensor sizes, chunks
    and dtypes that fit together; shard files that are regular files inside ``folder`` (see
    :func:`~flashdist.checkpoint.files.inside`) and hold each record's bytes; no tensor larger than the bytes
    its records hold (so building a tensor for it costs at most the size of the files), nor records much longer
    than their tensors (so reading one costs about its tensor); planner routes whose
    list indices the entries pay for (:func:`~flashdist.checkpoint.files.check_routes`); and no storage
    transforms (compression), whose output the file's size would not bound."""
    try:
        _check_metadata(metadata, folder, Path(folder) / ".metadata")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing field, an unhashable key, ...: damage, said in one line
        raise CheckpointError(f"flashdist: {Path(folder) / '.metadata'} is not valid DCP metadata ({reason(e, 100)}); "
                              "the checkpoint is damaged or was not written by "
                              "torch.distributed.checkpoint") from None


def _check_metadata(metadata: Any, folder: str | os.PathLike, source: Path) -> None:
    def refuse(what: str):
        raise CheckpointError(f"flashdist: {source} {what}; the checkpoint is damaged or was not written by "
                              "torch.distributed.checkpoint")

    def dims(value, what: str) -> tuple[int, ...]:
        if not isinstance(value, tuple) or len(value) > 64 or \
                not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in value):
            refuse(f"holds an invalid {what} {shown(value)}")
        return value

    if not isinstance(metadata, Metadata):
        refuse(f"holds a {type(metadata).__name__}, not DCP metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        refuse("has no table of entries")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        refuse("holds an invalid storage record")
    if not isinstance(metadata.storage_data, dict):
        refuse("names no shard files (it was not written by DCP's FileSystemWriter)")
    # the shard files and the bytes each entry's records hold in them
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    records: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str) or not isinstance(info, _StorageInfo):
            refuse("holds an invalid storage record")
        name = info.relative_path
        if name not in sizes:
            real = inside(folder, name, source=source)
            if not os.path.lexists(real):
                raise CheckpointError(f"flashdist: could not read checkpoint {folder}: its shard file {shown(name)} is "
                                      "missing")
            sizes[name] = regular_size(real, expected="a DCP shard file")
        offset, length = info.offset, info.length
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)):
            refuse(f"places {index.fqn[:80]!r} at an invalid offset or length")
        if offset + length > sizes[name]:
            if _written_by(inside(folder, name)) != _save_id_of(metadata):  # a shard of another save: said so
                verify_shard(inside(folder, name), _save_id_of(metadata), crc=False)
            raise CheckpointError(f"flashdist: could not read checkpoint {folder}: shard file {shown(name)} is "
                                  f"truncated or damaged ({sizes[name]:,} bytes; its .metadata places "
                                  f"{index.fqn[:80]!r} at bytes "
                                  f"{offset:,} to {offset + length:,})")
        if getattr(info, "transform_descriptors", None):
            refuse(f"stores {index.fqn[:80]!r} transformed ({shown(info.transform_descriptors)}), which flashdist "
                   "does not read")
        stored[index.fqn] = stored.get(index.fqn, 0) + length
        records[index.fqn] = records.get(index.fqn, 0) + 1
    for key, meta in entries.items():
        if not isinstance(key, str):
            refuse(f"holds an entry named by a {type(key).__name__}")
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata) or not isinstance(meta.properties, _TENSOR_PROPERTIES) \
                or not isinstance(meta.properties.dtype, torch.dtype) or not isinstance(meta.chunks, list):
            refuse(f"holds an invalid entry {key[:80]!r}")
        size = dims(meta.size, f"size of {key[:80]!r}")
        covered = 0
        for chunk in meta.chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                refuse(f"holds an invalid chunk of {key[:80]!r}")
            offsets, lengths = dims(chunk.offsets, "chunk offset"), dims(chunk.sizes, "chunk size")
            if len(offsets) != len(size) or len(lengths) != len(size) or \
                    any(o + n > d for o, n, d in zip(offsets, lengths, size)):
                refuse(f"holds a chunk of {key[:80]!r} outside its size {list(size)}")
            covered += math.prod(lengths)
        numel = math.prod(size)
        itemsize = meta.properties.dtype.itemsize
        if covered < numel or numel * itemsize > stored.get(key, 0):
            refuse(f"gives {key[:80]!r} {numel:,} elements ({list(size)[:8]}) but its records hold "
                   f"{stored.get(key, 0):,} bytes")
        if stored.get(key, 0) > covered * itemsize + records.get(key, 0) * _RECORD_SLACK:
            refuse(f"gives {key[:80]!r} {numel:,} elements ({list(size)[:8]}) in records of {stored[key]:,} bytes, "
                   "far more than torch.save writes for them")
    routes = metadata.planner_data
    if routes is not None:
        if not isinstance(routes, dict) or not all(isinstance(k, str) for k in routes):
            refuse("holds invalid planner data")
        check_routes(routes.values(), slack=len(entries) + 64, source=source)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        check_torch_stream(value, len(value.getbuffer()), f"checkpoint entry '{read_item.dest_index.fqn}'")
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"flashdist: checkpoint entry '{read_item.dest_index.fqn}' is not plain data "
                                  f"and was refused (weights_only=True): {e}") from None
        check_nesting(obj, f"checkpoint entry '{read_item.dest_index.fqn}'")
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


def _written_by(file: Path) -> str | None:
    """The save id in the header of shard ``file``; None when it has none."""
    with open_regular(file, expected="a DCP shard file") as f:
        head = f.read(_HEADER_SIZE)
    return head[len(_SHARD_MAGIC):].decode(errors="replace") if head.startswith(_SHARD_MAGIC) else None


def verify_shard(file: str | os.PathLike, save_id: str | None, *, crc: bool = True) -> None:
    """Raise :class:`CheckpointError` naming ``file`` unless it is an intact shard of the save ``save_id``
    (the id in its checkpoint's ``.metadata``; None for a checkpoint written before shards carried ids, whose
    shards cannot be checked but must not be shards of a newer save either). With ``crc`` it reads the whole
    file once to check its CRC-32; without, only its first and last bytes (id, length)."""
    file = Path(file)
    try:
        with open_regular(file, expected="a DCP shard file") as f:
            head = f.read(_HEADER_SIZE)
            tied = head.startswith(_SHARD_MAGIC)
            if save_id is None:
                if tied:
                    written = printable(head[len(_SHARD_MAGIC):].decode(errors="replace"))
                    raise CheckpointError(f"flashdist: shard {file} was written by save {written}, but the "
                                          "checkpoint's .metadata predates shard ids: the folder mixes files of two "
                                          "saves")
                return
            if head != _SHARD_MAGIC + save_id.encode():
                found = printable(head[len(_SHARD_MAGIC):].decode(errors="replace")) if tied else "no flashdist save id"
                raise CheckpointError(f"flashdist: shard {file} belongs to another save ({found}) than its "
                                      f"checkpoint's .metadata ({printable(save_id)}): the folder mixes files of two "
                                      "saves; restore the original file or load another checkpoint")
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

