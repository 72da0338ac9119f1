"""Opening the files a checkpoint names: the one safety policy of every flashdist reader.

A checkpoint may come from anyone (shared storage, a colleague's folder, a download), and the names inside
it (a DCP ``.metadata``'s shard paths, a DeepSpeed ``latest`` tag, the files of a tag folder) are data of
that file, not the user's word. Every reader resolves such names through :func:`inside` and opens files
through :func:`open_regular`:

- Confined: a name must be relative, without ``..``, and must resolve (symbolic links followed) inside the
  folder the user named. A symbolic link that stays inside the folder is fine; one that leads out of it is
  refused, unless the user sets ``FLASHDIST_FOLLOW_LINKS=1`` (:data:`FOLLOW_LINKS`), for a folder whose files
  are links into a store of their own. ``..`` and absolute names are refused even then.
- Regular files only: a FIFO, a device, a socket or a directory where a file is expected is refused in one
  line, before it is opened for reading (a FIFO would block forever, a device could be endless). The check
  is repeated on the open descriptor (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``), so a file swapped in
  between is refused too.
- Bounded: :func:`read_bounded` reads a whole small file (a ``.metadata``, a ``latest`` tag) only when it is
  at most a stated number of bytes. What a reader builds from a checkpoint's metadata (a DCP ``.metadata``'s
  objects, a safetensors header, a torch file's pickle and zip directory) is held within one budget,
  :func:`metadata_budget` (512 MiB unless :data:`METADATA_BUDGET` says otherwise), checked from the file's
  bytes before it is parsed: so ``flashdist inspect`` of any input peaks within that budget above the
  interpreter.

Every refusal is a :class:`~flashdist.checkpoint.errors.CheckpointError` of one line naming the file.
"""

from __future__ import annotations

import io
import os
import reprlib
import stat
from pathlib import Path, PurePath

from .errors import CheckpointError

FOLLOW_LINKS = "FLASHDIST_FOLLOW_LINKS"
"""Environment variable: ``1`` lets the names in a checkpoint resolve through symbolic links that lead out of
its folder (``..`` and absolute names stay refused)."""

METADATA_BUDGET = "FLASHDIST_METADATA_MIB"
"""Environment variable: the memory (MiB) a reader may spend on one checkpoint's metadata (default
:data:`DEFAULT_METADATA_MIB`); raise it for a checkpoint whose metadata is larger (thousands of ranks)."""
DEFAULT_METADATA_MIB = 512
"""The default budget: a DCP ``.metadata`` of a Llama-3-8B state (FlashAdamW, compressed) on 8 ranks is 2.2 MiB
and counts about 100 MiB (28 MiB once unpickled); metadata grows with the ranks, so the default holds such a
state on about 40 ranks, a 70B model's on about 16."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def follow_links() -> bool:
    """True when the user opted in to symbolic links out of a checkpoint folder (:data:`FOLLOW_LINKS`)."""
    return os.environ.get(FOLLOW_LINKS, "").strip().lower() in ("1", "true", "yes")


def metadata_budget() -> int:
    """The bytes a reader may spend on one checkpoint's metadata (:data:`METADATA_BUDGET`)."""
    text = os.environ.get(METADATA_BUDGET, "").strip()
    if not text:
        return DEFAULT_METADATA_MIB << 20
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise CheckpointError(f"flashdist: {METADATA_BUDGET}={shown(text)} is not a number of MiB above 0")
    return int(mib * (1 << 20))


def over_budget(path, cost: int, what: str) -> CheckpointError:
    """The one-line refusal of ``path``, whose ``what`` (its metadata, say) would take ``cost`` bytes of memory
    to read, more than :func:`metadata_budget`."""
    budget = metadata_budget()
    need = max(int(cost / (1 << 20)) + 1, 2 * (budget >> 20))
    return CheckpointError(f"flashdist: {printable(path)}: reading {what} would take about {_mib(cost)} MiB of memory, "
                           f"more than the {_mib(budget)} MiB budget for a checkpoint's metadata; refused (set "
                           f"{METADATA_BUDGET}={need} to read it)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f}" if n >= 10 << 20 else f"{n / (1 << 20):.2g}"


def shown(value, limit: int = 80) -> str:
    """A value taken from a file, safe to print in an error: a short repr (non-printable characters escaped,
    long containers elided), cut to ``limit`` characters."""
    text = _SHORT.repr(str(value) if isinstance(value, PurePath) else value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxtuple, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 8, 8, 4, 78, 40


def printable(text) -> str:
    """``text`` (a path holding a name read from a file, say) with non-printable characters escaped, so an
    error message cannot carry terminal control sequences from a crafted file."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def reason(e: BaseException, limit: int = 200) -> str:
    """An exception met while parsing a file, as one short printable line for an error message."""
    text = printable(" ".join(str(e).split())[:limit])
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def inside(folder: str | os.PathLike, name, *, source: str | os.PathLike | None = None) -> Path:
    """``folder / name`` (symbolic links resolved), where ``name`` was read from a checkpoint file (``source``,
    named in the error). Raises :class:`CheckpointError` unless ``name`` is a relative path without ``..``
    that stays inside ``folder`` (links out allowed only under :data:`FOLLOW_LINKS`)."""
    where = f" (named in {source})" if source is not None else ""
    if not isinstance(name, (str, PurePath)) or not str(name) or "\x00" in str(name):
        raise CheckpointError(f"flashdist: {folder} holds a file name {shown(name)}{where} that is not a file name; "
                              "the checkpoint is damaged or crafted")
    parts = PurePath(name).parts
    if PurePath(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"flashdist: the name {shown(name)}{where} leads outside {folder}; a checkpoint names "
                              "only files inside its own folder. Refused")
    root = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(root / name))
    if not target.is_relative_to(root) and not follow_links():
        raise CheckpointError(f"flashdist: {printable(Path(folder) / name)}{where} is a symbolic link that leads "
                              f"outside {folder}; refused (set {FOLLOW_LINKS}=1 to follow links out of a checkpoint "
                              "folder)")
    return target


def _refuse_kind(mode: int, path, expected: str) -> None:
    for test, kind in _KINDS:
        if test(mode):
            raise CheckpointError(f"flashdist: {printable(path)} is {kind}, not {expected}; refused")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"flashdist: {printable(path)} is not {expected}; refused")


def regular_size(path: str | os.PathLike, *, expected: str = "a regular file") -> int:
    """The size of ``path`` after checking that it is a regular file (symbolic links followed: confine the
    name with :func:`inside` first); :class:`CheckpointError` naming it otherwise (missing, FIFO, ...)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"flashdist: {printable(path)} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot read {printable(path)}: {e.strerror or e}") from None
    _refuse_kind(st.st_mode, path, expected)
    return st.st_size


def open_regular(path: str | os.PathLike, *, expected: str = "a regular file") -> io.BufferedReader:
    """``path`` opened for reading in binary, if it is a regular file; a FIFO, device, socket or directory is
    refused without blocking. The last component is opened without following a link (``O_NOFOLLOW``): resolve
    it with :func:`inside` (or :func:`os.path.realpath` for a path the user named) first."""
    regular_size(path, expected=expected)  # refuse a device before opening it: opening one may act
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot open {printable(path)}: {e.strerror or e}") from None
    try:
        _refuse_kind(os.fstat(fd).st_mode, path, expected)  # swapped after the stat above
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return open(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, *, expected: str = "a regular file") -> bytes:
    """The whole of regular file ``path``, refused (one line) when it holds more than ``limit`` bytes."""
    with open_regular(path, expected=expected) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"flashdist: {printable(path)} holds {size:,} bytes, more than the {limit:,} such a "
                                  "file may hold; refused")
        try:
            data = f.read(size + 1)  # read(n) sets n bytes aside at once: ask for what the file holds
        except OSError as e:
            raise CheckpointError(f"flashdist: cannot read {printable(path)}: {e.strerror or e}") from None
    if len(data) != size:
        raise CheckpointError(f"flashdist: {printable(path)} changed while it was read; try again")
    return data


def check_routes(routes, *, slack: int, source: str | os.PathLike) -> None:
    """Refuse (one line naming ``source``) a set of routes into a nested checkpoint dict (keys and list indices,
    outermost first, as a DCP ``.metadata``'s planner data or a safetensors file's ``route:`` entries give
    them) that would make a reader build more than it holds: a list index must be paid for by the routes
    through it, within ``slack`` empty slots in all; a node is a list (int keys) or a dict (str keys), never
    both, and never also a leaf."""
    lists: dict[tuple, int] = {}  # list node -> largest index
    kinds: dict[tuple, type] = {}
    leaves: set[tuple] = set()
    paid = 0
    for route in routes:
        if not isinstance(route, (tuple, list)) or not route or len(route) > 64:
            raise CheckpointError(f"flashdist: {source} holds a malformed entry route {shown(route)}; the checkpoint "
                                  "is damaged or crafted")
        for depth, part in enumerate(route):
            prefix = tuple(route[:depth])
            kind = (int if isinstance(part, int) and not isinstance(part, bool)
                    else str if isinstance(part, str) else None)
            if kind is None or (kind is int and part < 0) or kinds.setdefault(prefix, kind) is not kind \
                    or prefix in leaves:
                raise CheckpointError(f"flashdist: {source} holds an entry route {shown(list(route))} that conflicts "
                                      "with the others or holds something other than names and list indices; the "
                                      "checkpoint is damaged or crafted")
            if kind is int:
                paid += 1
                if part >= lists.get(prefix, -1):
                    lists[prefix] = part
                    if part > paid + slack:  # checked early: one huge index refuses before the sum below
                        break
        key = tuple(route)
        if key in kinds or key in leaves:
            raise CheckpointError(f"flashdist: {source} holds the entry route {shown(list(route))} twice or inside "
                                  "another entry; the checkpoint is damaged or crafted")
        leaves.add(key)
    slots = sum(i + 1 for i in lists.values())
    if slots > paid + slack:
        raise CheckpointError(f"flashdist: {source} names list indices up to {max(lists.values()):,} for "
                              f"{len(leaves):,} entries; the checkpoint is damaged or crafted")


# What a reader builds per byte of a file's metadata, at most (bytes), for the checks below: a torch file's pickle
# (torch's weights_only unpickler: the densest crafted pickles build about 75 bytes per byte, a real one about
# 15), a zip directory (a ZipInfo per entry of at least 46 bytes), a safetensors header (one parsed entry and
# the route, spec and name a reader keeps per tensor, for at least 40 bytes of JSON).
_PICKLE_COST, _ZIP_DIRECTORY_COST, _SAFETENSORS_HEADER_COST = 128, 16, 32
_JSON_COST = 32  # json.loads builds at most about 24 bytes per byte of text (a list of empty dicts)


def read_json(path: str | os.PathLike, *, expected: str = "a JSON file"):
    """The JSON value in regular file ``path`` (a shard index, trainer_state.json), read when parsing it fits
    :func:`metadata_budget`; one line naming the file otherwise, or when it is not JSON."""
    import json

    size = regular_size(path, expected=expected)
    if _JSON_COST * size > metadata_budget():
        raise over_budget(path, _JSON_COST * size, "it")
    try:
        return json.loads(read_bounded(path, size, expected=expected))
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"flashdist: cannot read {printable(path)}: {reason(e)}") from None


def check_torch_file(path: str | os.PathLike) -> None:
    """Refuse (one line naming ``path``) a ``torch.save`` file whose reading could cost more than the file
    holds or more than :func:`metadata_budget`, before ``torch.load`` sees it: it must be a zip whose records are
    all stored uncompressed (as ``torch.save`` writes them: a compressed record could inflate a small file to
    gigabytes) and lie inside the file, and whose directory and pickles fit the budget. The sizes of tensors
    are checked by ``torch.load`` itself against their records."""
    size = regular_size(path, expected="a torch file")
    with open_regular(path, expected="a torch file") as f:
        check_torch_stream(f, size, path)


def check_torch_stream(f, size: int, name) -> None:
    """:func:`check_torch_file` of an open binary stream ``f`` of ``size`` bytes (a DCP entry, say), named
    ``name`` in the error."""
    import zipfile

    try:
        end = zipfile._EndRecData(f)  # the end record only: how large the directory is, before reading it
        if end is None:
            raise CheckpointError(f"flashdist: could not read {printable(name)}: it has no zip directory at its end "
                                  "(it is truncated, or of torch's format before 1.6: load it and save it again)")
        directory = end[zipfile._ECD_SIZE]
        if directory > size:
            raise CheckpointError(f"flashdist: {printable(name)} names a zip directory of {directory:,} bytes in "
                                  f"{size:,}; it is damaged or crafted")
        if _ZIP_DIRECTORY_COST * directory > metadata_budget():
            raise over_budget(name, _ZIP_DIRECTORY_COST * directory, "its zip directory")
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            cost = _ZIP_DIRECTORY_COST * directory
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size \
                        or info.header_offset + info.file_size > size:
                    raise CheckpointError(f"flashdist: {printable(name)} holds the record {shown(info.filename)} "
                                          "compressed or beyond its end, which torch.save never writes; refused")
                if info.filename.endswith(".pkl"):
                    cost += _PICKLE_COST * info.file_size
            if cost > metadata_budget():
                raise over_budget(name, cost, "its pickled structure")
        f.seek(0)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zip directory
        raise CheckpointError(f"flashdist: {printable(name)} is not a valid torch.save file ({reason(e)}); it is "
                              "damaged or was written by another program") from None


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Refuse (one line naming ``path``) a safetensors file whose header length (its first 8 bytes) exceeds the
    file, or whose header would cost more than :func:`metadata_budget` to parse, before it is parsed."""
    size = regular_size(path, expected="a safetensors file")
    with open_regular(path, expected="a safetensors file") as f:
        head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= size - 8:
        raise CheckpointError(f"flashdist: {printable(path)} names a header of {length:,} bytes in a file of "
                              f"{size:,}; it is not a safetensors file, or it is damaged or crafted")
    if _SAFETENSORS_HEADER_COST * length > metadata_budget():
        raise over_budget(path, _SAFETENSORS_HEADER_COST * length, "its header")


MAX_NESTING = 100
"""The deepest nesting of lists, tuples and dicts read from a file's plain data (``save`` cannot write one much
deeper than Python's recursion limit allows; readers copy and walk it recursively)."""


def check_nesting(obj, what) -> None:
    """Refuse (one line naming ``what``, a file or an entry) plain data nesting lists, tuples or dicts more than
    :data:`MAX_NESTING` deep, checked without recursion."""
    todo = [(obj, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, (list, tuple)):
            if depth >= MAX_NESTING:
                raise CheckpointError(f"flashdist: {printable(what)} nests lists or dicts more than {MAX_NESTING} "
                                      "deep; it is damaged or crafted")
            todo.extend((child, depth + 1) for child in node)


def structure_only(obj):
    """``obj`` (a file's contents as ``torch.load(mmap=True)`` gives them: the tensors mapped, not read) with each
    tensor of one or more dimensions replaced by a meta tensor of its shape, dtype and strides, tensors that
    shared storage sharing a meta storage (tied weights stay tied); 0-dimensional ones (step counts) are copied
    out as CPU scalars. Containers are changed in place (tuples holding tensors rebuilt); other objects are left
    as they are, unread. Nothing of the mapped data is read but the scalars, so a reader run on the result (a
    DeepSpeed reassembly, a flashoptim decoding) gives the shapes and dtypes of its output in memory
    independent of the tensors' sizes: that of the file's pickle, which :func:`check_torch_file` holds within
    :func:`metadata_budget`."""
    import torch

    storages: dict[int, tuple] = {}  # the mapped storage (held: its key stays its own) and its meta twin

    def meta(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:  # a step count; and torch computes with a 0-dim CPU tensor on any device
            return t.detach().clone()
        storage = t.untyped_storage()
        key = storage._cdata  # one key per storage, shared by the tensors that view it
        if key not in storages:
            storages[key] = (storage, torch.UntypedStorage(storage.nbytes(), device="meta"))
        return torch.empty(0, dtype=t.dtype, device="meta").set_(storages[key][1], t.storage_offset(), t.shape,
                                                                  t.stride())

    def walk(node):
        if isinstance(node, torch.Tensor):
            return meta(node)
        if isinstance(node, dict):
            for k, v in node.items():
                node[k] = walk(v)
        elif isinstance(node, list):
            node[:] = [walk(v) for v in node]
        elif isinstance(node, tuple) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in node):
            return tuple(walk(v) for v in node)  # a torch.Size or a tuple of plain values stays as it is
        return node

    return walk(obj)
