"""Writing conversion outputs safely, one tensor at a time.

Safety. :func:`check_destination` refuses a destination that is the source, lies inside it or holds it, and
an existing destination unless ``force`` is given and the destination is a previous output of the same kind,
recognised by its files' types and headers (a folder that holds anything else, or a link, is never replaced).
:func:`atomic_output` writes to a temporary name unique to the run, beside the destination, created without
following links and locked (flock) for the run; on success it gets the modes ``open``/``mkdir`` give under the
umask, is fsynced and moved into place so that the destination holds the old or the new output at every
instant; on any failure the temporary output is removed and the error is raised as a one-line
:class:`CheckpointError` naming the destination (a full disk said as such). The leftovers of a killed run
(its temporary output, a previous output it moved aside) are removed or put back by the next run writing the
same destination, or by ``flashdist clean`` (:func:`output_leftovers`).

Streaming. The writers take the tensors' shapes and dtypes up front (``specs``) and a ``fetch`` that returns
one tensor when the writer needs it, so the peak memory of a write is the largest tensor, not the checkpoint:

- safetensors: the header is built from the specs, then each tensor's bytes are appended in header order.
- torch: ``torch.save`` of the structure with fake tensors under ``torch.serialization.skip_data`` reserves
  each storage's bytes in the zip; each record is then filled in place at the offset torch's own reader gives.
- DCP: ``dcp.save`` of meta tensors with a planner whose ``resolve_data`` fetches the real tensor as the
  file writer reaches it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .dcp_files import shard_writer
from .errors import CheckpointError, error_summary, write_failure
from .ownership import Leftover, exchange, is_plain_dir, lexists, publish_mode, sniff, unrecognised
from .publish import fcntl, flock

Spec = tuple[tuple[int, ...], torch.dtype]
Fetch = Callable[[Any], torch.Tensor]

# ----- destinations ----------------------------------------------------------------------------------------

_TEMP = r"\.{name}\.[a-z0-9_]{{8}}\.tmp"  # a run's temporary output (8 characters: this run's, and mkstemp's before)
_ASIDE = r"\.{name}\.[0-9a-f]{{8}}\.old"  # a previous folder output moved aside (where no atomic swap exists)


def _torch_zip(path: Path) -> bool:
    """A zip whose first record is a torch pickle (``<archive>/data.pkl``), as ``torch.save`` writes it."""
    try:
        with open(path, "rb") as f:
            head = f.read(30 + 256)
    except OSError:
        return False
    size = int.from_bytes(head[26:28], "little")
    return head.startswith(b"PK\x03\x04") and head[30:30 + size].endswith(b"data.pkl")


def output_kind(path: Path) -> str | None:
    """What an existing ``path`` is as a conversion output, by its files' types and headers (never by names
    alone: :mod:`flashdist.checkpoint.ownership`): "dcp" (a folder of DCP files only), "hf" (a folder of a
    Hugging Face export only), "torch" or "safetensors" (a file), or None (anything else, a link included)."""
    if path.is_symlink():
        return None
    if is_plain_dir(path):
        try:
            names = os.listdir(path)
            if names and ".metadata" in names and not unrecognised(path, "dcp"):
                return "dcp"
            if names and any(n.endswith(".safetensors") for n in names) and not unrecognised(path, "hf"):
                return "hf"
        except OSError:
            pass
        return None
    found = sniff(path)
    if found == "zip" and _torch_zip(path):
        return "torch"
    return "safetensors" if found == "safetensors" else None


def check_destination(sources: list[Path], dst: Path, kind: str, force: bool) -> None:
    """Refuse ``dst`` before anything is read or written: equal to, inside or a parent of a source; existing
    without ``force``; existing with ``force`` but not a previous ``kind`` output (dcp, hf, torch,
    safetensors). Before the existence checks, the leftovers of killed runs writing ``dst`` are removed, and a
    previous output they left moved aside is put back (:func:`output_leftovers`)."""
    where = dst.resolve()
    for src in sources:
        src = src.resolve()
        if where == src or where.is_relative_to(src) or src.is_relative_to(where):
            relation = "is" if where == src else ("lies inside" if where.is_relative_to(src) else "holds")
            raise CheckpointError(f"flashdist: the destination {dst} {relation} the source {src}; write the output "
                                  "elsewhere")
    try:
        output_leftovers(dst, apply=True)
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot write {dst}: {error_summary(e)}") from e
    if not lexists(dst):
        return
    if not force:
        raise CheckpointError(f"flashdist: {dst} exists; pass --force (force=True) to replace it")
    found = output_kind(dst)
    if kind in ("dcp", "hf") and is_plain_dir(dst) and not os.listdir(dst):
        return  # an empty folder holds nothing to lose
    if found != kind:
        what = {"dcp": "a DCP checkpoint folder", "hf": "a Hugging Face model folder", "torch": "a torch file",
                "safetensors": "a safetensors file"}[kind]
        raise CheckpointError(f"flashdist: {dst} is not {what} written by flashdist (it is "
                              f"{_describe(dst)}); --force replaces only a previous output of the same kind, "
                              "recognised by its files' headers: remove it yourself or choose another destination")


def _describe(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link"
    if is_plain_dir(path):
        try:
            bad = unrecognised(path, "dcp" if ".metadata" in os.listdir(path) else "hf")
        except OSError:
            bad = []
        return "a folder holding other entries" + (f": {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
                                                    if bad else "")
    return "another kind of file"


def _held(path: Path) -> bool | None:
    """Whether a live run holds the lock on the temporary output (or the output moved aside) ``path``: True,
    False, or None when this file system cannot lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        got = flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if fcntl else 0)
        return None if got is None else not got
    finally:
        os.close(fd)


def _partial_output(path: Path) -> bool:
    """A temporary output as flashdist writes one, complete or not: a file that is empty or starts as a torch
    zip or a safetensors file, or a folder of DCP or Hugging Face files only (each by its header)."""
    if not is_plain_dir(path):
        return sniff(path) in ("empty", "zip", "safetensors")
    try:
        return not unrecognised(path, "dcp", partial=True) or not unrecognised(path, "hf", partial=True)
    except OSError:
        return False


def output_leftovers(dst: str | os.PathLike, *, apply: bool) -> list[Leftover]:
    """What killed ``convert``/``export`` runs writing ``dst`` left beside it: temporary outputs
    (``.DST.<random>.tmp``) whose run is dead, removed when ``apply``, and a previous folder output moved aside
    (``.DST.<random>.old``: only where no atomic swap exists), put back at ``dst`` when ``dst`` is missing and
    removed otherwise. Anything held by a live run, or not recognisably flashdist's, is listed as "keep"."""
    dst = Path(dst)
    parent = dst.parent if str(dst.parent) else Path(".")
    temp = re.compile(_TEMP.format(name=re.escape(dst.name)))
    aside = re.compile(_ASIDE.format(name=re.escape(dst.name)))
    try:
        names = sorted(os.listdir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: list[Leftover] = []
    for name in names:
        is_temp, is_aside = temp.fullmatch(name), aside.fullmatch(name)
        if not (is_temp or is_aside):
            continue
        path = parent / name
        alive = _held(path)
        what = ("the temporary output of a convert or export that did not finish" if is_temp
                else f"the previous {dst.name}, moved aside by a --force run killed before it finished")
        if alive:
            found.append(Leftover(path, what, "keep", "a live convert or export is writing it"))
        elif not (_partial_output(path) if is_temp else output_kind(path)):
            found.append(Leftover(path, what, "keep", "its files are not recognisably flashdist's: remove it "
                                  "yourself"))
        elif alive is None:
            found.append(Leftover(path, what, "keep", "this file system cannot lock files, so a live run cannot be "
                                  "told from a dead one: remove it yourself when none is running"))
        elif is_aside and not lexists(dst):
            found.append(Leftover(path, what, "restore"))
            if apply:
                os.rename(path, dst)
        else:
            found.append(Leftover(path, what, "remove"))
            if apply:
                _remove(path)
    return found


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if is_plain_dir(path):
        for p in path.iterdir():
            _fsync_tree(p)
    _fsync(path)


def _remove(path: Path) -> None:
    if is_plain_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


short_error = error_summary  # its former name here


def _locked_temp(parent: Path, name: str, directory: bool) -> tuple[Path, int]:
    """A new private temporary output beside the destination (a folder when ``directory``) and a descriptor
    holding an exclusive flock on it for the run, so a cleaner tells it from a dead run's. Created without
    following links (O_EXCL / mkdir never do)."""
    while True:
        tmp = parent / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            if directory:
                os.mkdir(tmp, 0o700)
                fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            else:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except (FileExistsError, FileNotFoundError):
            continue  # a name taken, or a cleaner removed it before we held it: draw another
        locked = flock(fd, fcntl.LOCK_EX if fcntl else 0)
        try:
            if locked is None or os.path.samestat(os.fstat(fd), os.lstat(tmp)):
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _into_place(tmp: Path, dst: Path, directory: bool) -> None:
    """Move the finished ``tmp`` to ``dst`` so that ``dst`` holds the old or the new output at every instant:
    a file by one rename; a folder over a previous one by an atomic swap, then the old one (now under the
    temporary name) removed; where no swap exists, the old folder is moved aside (locked, so no cleaner takes
    it), the new one renamed into place, the old one removed. A run killed between those two renames leaves
    the old output aside, put back by the next run or ``flashdist clean``."""
    if not (directory and is_plain_dir(dst)):
        os.replace(tmp, dst)
        return
    if exchange(tmp, dst):
        _remove(tmp)
        return
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        flock(fd, fcntl.LOCK_EX if fcntl else 0)
        old = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.old"
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old, dst)  # the previous output back in place
            raise
        _remove(old)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(dst: Path, *, directory: bool) -> Iterator[Path]:
    """A temporary path (a new empty folder when ``directory``) beside ``dst``, unique to this call and locked
    for it; when the block succeeds, given the modes ``open``/``mkdir`` give under the umask, fsynced and moved
    to ``dst`` (:func:`_into_place`; a previous output, which :func:`check_destination` vetted, is replaced);
    removed when it fails, the error raised as one line naming ``dst`` (a full disk said as such)."""
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp, fd = _locked_temp(parent, dst.name, directory)
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot write {dst}: {write_failure(e, parent)}") from e
    try:
        yield tmp
        publish_mode(tmp, directory=directory)
        _fsync_tree(tmp)
        _into_place(tmp, dst, directory)
        _fsync(parent)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"flashdist: could not write {dst}: {write_failure(e, parent)}; nothing was "
                              "written") from e
    finally:
        os.close(fd)


# ----- safetensors -----------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                       torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _nbytes(spec: Spec) -> int:
    shape, dtype = spec
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_safetensors(path: Path, specs: dict[str, Spec], fetch: Fetch, metadata: dict[str, str] | None = None,
                      progress: Callable[[str, int, int], None] | None = None) -> None:
    """Write a safetensors file (https://github.com/huggingface/safetensors, its documented layout: 8-byte
    little-endian header size, JSON header, the tensors' bytes) from ``specs`` (name -> (shape, dtype)), one
    ``fetch(name)`` at a time."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, spec in specs.items():
        if spec[1] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"flashdist: tensor '{name}' is {spec[1]}, which safetensors cannot store")
        size = _nbytes(spec)
        header[name] = {"dtype": SAFETENSORS_DTYPES[spec[1]], "shape": list(spec[0]),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i, (name, spec) in enumerate(specs.items()):
            if progress:
                progress("writing", i, len(specs))
            t = fetch(name)
            _check_fetched(name, t, spec)
            f.write(_tensor_bytes(t))
            del t
        if progress:
            progress("writing", len(specs), len(specs))


def _check_fetched(name, t: torch.Tensor, spec: Spec) -> None:
    if tuple(t.shape) != tuple(spec[0]) or t.dtype != spec[1]:
        raise CheckpointError(f"flashdist: '{name}' read as {tuple(t.shape)} {t.dtype}, expected {tuple(spec[0])} "
                              f"{spec[1]}: the source changed while it was read?")


# ----- torch -----------------------------------------------------------------------------------------------


def _iter_tensors(node, route: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(route, leaf) of every tensor placeholder in pickling order: dict items in order, list items in order."""
    if isinstance(node, _Slot):
        yield route, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _iter_tensors(v, route + (k,))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _iter_tensors(v, route + (i,))


class _Slot:
    def __init__(self, route):
        self.route = route


def _fill(node, make: Callable[[tuple], Any]):
    if isinstance(node, _Slot):
        return make(node.route)
    if isinstance(node, dict):
        return {k: _fill(v, make) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, make) for v in node]
    if isinstance(node, tuple):
        return tuple(_fill(v, make) for v in node)
    return node


def skeleton(rest, specs: dict[tuple, Spec]):
    """``rest`` (the nested checkpoint with each tensor as None) with a placeholder at each route of ``specs``."""
    out = _copy(rest)
    for route in specs:
        node = out
        for part in route[:-1]:
            node = node[part]
        node[route[-1]] = _Slot(route)
    return out


def _copy(node):
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node


def write_torch(path: Path, rest, specs: dict[tuple, Spec], fetch: Fetch,
                progress: Callable[[str, int, int], None] | None = None) -> None:
    """Write ``torch.save`` of the nested checkpoint (``rest`` with the tensors of ``specs`` put back at their
    routes), fetching one tensor at a time: the structure is saved with fake tensors under
    ``torch.serialization.skip_data``, which reserves each storage's bytes, then each record is filled in
    place. Every tensor has a storage of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tree = skeleton(rest, specs)
    with FakeTensorMode() as mode:
        fakes = {route: torch.empty(spec[0], dtype=spec[1]) for route, spec in specs.items()}
    del mode
    structure = _fill(tree, fakes.__getitem__)
    order = [route for route, _ in _iter_tensors(tree)]  # torch.save numbers storages as it pickles them
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(structure, path)
    del structure, fakes
    reader = torch._C.PyTorchFileReader(str(path))
    records = {name.rsplit("/", 1)[-1]: name for name in reader.get_all_records() if "/data/" in f"/{name}"
               and name.rsplit("/", 2)[-2] == "data"}
    if len(records) != len(order):
        raise CheckpointError(f"flashdist: {path}: torch.save wrote {len(records)} storages for {len(order)} "
                              "tensors; cannot fill them")
    offsets = {route: reader.get_record_offset(records[str(i)]) for i, route in enumerate(order)}
    del reader
    with open(path, "r+b") as f:
        for i, route in enumerate(order):
            if progress:
                progress("writing", i, len(order))
            t = fetch(route)
            _check_fetched(".".join(map(str, route)), t, specs[route])
            f.seek(offsets[route])
            f.write(_tensor_bytes(t))
            del t
        if progress:
            progress("writing", len(order), len(order))


# ----- DCP -------------------------------------------------------------------------------------------------


def write_dcp(path: Path, rest, specs: dict[tuple, Spec], fetch: Fetch) -> None:
    """``dcp.save`` of the nested checkpoint into the (new, empty) folder ``path``, one tensor at a time: the
    plan is made from meta tensors and each tensor is fetched when the file writer reaches it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tree = skeleton(rest, specs)
    state = _fill(tree, lambda route: torch.empty(specs[route][0], dtype=specs[route][1], device="meta"))

    class _FetchingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            obj = self.lookup_object(write_item.index)
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                route = tuple(self.mappings[write_item.index.fqn]) if self.mappings else None
                t = fetch(route)
                _check_fetched(write_item.index.fqn, t, specs[route])
                return t.detach().cpu().contiguous()
            return super().resolve_data(write_item)

    dcp.save(state, storage_writer=shard_writer(path), planner=_FetchingPlanner(),
             no_dist=True)
