"""Writing conversion outputs safely, one tensor at a time.

Safety. :func:`check_destination` refuses a destination that is the source, lies inside it or holds it, and
an existing destination unless ``force`` is given and the destination is a previous output of the same kind
(a folder that holds anything else is never replaced). :func:`atomic_output` writes to a temporary name unique
to the run, beside the destination; on success every file is fsynced and renamed into place (the directory
fsynced too), on any failure the temporary output is removed and the error is raised as a one-line
:class:`CheckpointError` naming the destination. A failed write leaves nothing behind and the destination
as it was.

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
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .dcp_files import shard_writer
from .errors import CheckpointError, error_summary

Spec = tuple[tuple[int, ...], torch.dtype]
Fetch = Callable[[Any], torch.Tensor]

# ----- destinations ----------------------------------------------------------------------------------------

_DCP_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
_HF_FILE = re.compile(r"^(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                      r"generation_config\.json)$")


def output_kind(path: Path) -> str | None:
    """What an existing ``path`` is as a conversion output: "dcp" (a folder of DCP files only), "hf" (a folder
    of a Hugging Face export only), "torch" or "safetensors" (a file), or None (anything else)."""
    if path.is_symlink():
        return None
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        if names and all(_DCP_FILE.match(n) for n in names) and ".metadata" in names:
            return "dcp"
        if names and all(_HF_FILE.match(n) for n in names) and any(n.endswith(".safetensors") for n in names):
            return "hf"
        return None
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(9)
        if head[:2] == b"PK":
            return "torch"
        if len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size:
            return "safetensors"
    return None


def check_destination(sources: list[Path], dst: Path, kind: str, force: bool) -> None:
    """Refuse ``dst`` before anything is read or written: equal to, inside or a parent of a source; existing
    without ``force``; existing with ``force`` but not a previous ``kind`` output (dcp, hf, torch,
    safetensors)."""
    where = dst.resolve()
    for src in sources:
        src = src.resolve()
        if where == src or where.is_relative_to(src) or src.is_relative_to(where):
            relation = "is" if where == src else ("lies inside" if where.is_relative_to(src) else "holds")
            raise CheckpointError(f"flashdist: the destination {dst} {relation} the source {src}; write the output "
                                  "elsewhere")
    if not (dst.exists() or dst.is_symlink()):
        return
    if not force:
        raise CheckpointError(f"flashdist: {dst} exists; pass --force (force=True) to replace it")
    found = output_kind(dst)
    if kind in ("dcp", "hf") and dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        return  # an empty folder holds nothing to lose
    if found != kind:
        what = {"dcp": "a DCP checkpoint folder", "hf": "a Hugging Face model folder", "torch": "a torch file",
                "safetensors": "a safetensors file"}[kind]
        raise CheckpointError(f"flashdist: {dst} is not {what} written by flashdist (it is "
                              f"{'a folder holding other files' if dst.is_dir() else 'another kind of file'}); "
                              "--force replaces only a previous output of the same kind: remove it yourself or "
                              "choose another destination")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    if path.is_dir():
        for p in path.iterdir():
            _fsync_tree(p)
    _fsync(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


short_error = error_summary  # its former name here


@contextlib.contextmanager
def atomic_output(dst: Path, *, directory: bool) -> Iterator[Path]:
    """A temporary path (a new empty folder when ``directory``) beside ``dst``, unique to this call; moved to
    ``dst`` when the block succeeds (replacing a previous output, which :func:`check_destination` vetted),
    removed when it fails, the error raised as a one-line CheckpointError naming ``dst``."""
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=parent)
            os.close(fd)
            tmp = Path(name)
    except OSError as e:
        raise CheckpointError(f"flashdist: cannot write {dst}: {error_summary(e)}") from e
    try:
        yield tmp
        _fsync_tree(tmp)
        if dst.is_dir() and not dst.is_symlink():  # a previous folder output: move it aside, then drop it
            old = parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.old"
            os.replace(dst, old)
            try:
                os.replace(tmp, dst)
            except BaseException:
                os.replace(old, dst)  # the previous output back in place
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
        _fsync(parent)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"flashdist: could not write {dst}: {error_summary(e)}; nothing was written") from e


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
