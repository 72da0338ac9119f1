"""The .metadata unpickler builds what dcp.save writes and nothing else: no function runs, no file-system
object is made, no tensor is allocated from the file's numbers, whatever the pickle names."""

from __future__ import annotations

import os
import pathlib
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _hostile import plain, saved

from flashdist import checkpoint
from flashdist.checkpoint import dcp_files, sources


class _Call:
    """Pickles as a call of ``fn(*args)`` (REDUCE): what a crafted .metadata holds."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(tmp_path: Path) -> dict[str, object]:
    marker = tmp_path / "ran"
    return {
        "os.system": _Call(os.system, f"touch {marker}"),
        "FileSystemWriter": _Call(dcp.FileSystemWriter, str(marker)),
        "FileSystemReader": _Call(dcp.FileSystemReader, str(marker)),
        "torch.empty": _Call(torch.empty, (3_000_000_000,)),
        "torch.full": _Call(torch.full, (1 << 20,), 1.0),
        "torch.Tensor": _Call(torch.Tensor, 1 << 20),
        "rebuild_tensor": _Call(torch._utils._rebuild_tensor_v2, None, 0, (1 << 20,), (1,), False, {}),
        "builtins.eval": _Call(eval, f"open({str(marker)!r}, 'w')"),
        "getattr": _Call(getattr, dcp.FileSystemWriter, "__init__"),
        "Path.write_text": _Call(Path.write_text, marker, "x"),
        "inside-metadata": {"state": _Call(os.system, f"touch {marker}")},
    }


@pytest.mark.parametrize("name", ["os.system", "FileSystemWriter", "FileSystemReader", "torch.empty", "torch.full",
                                  "torch.Tensor", "rebuild_tensor", "builtins.eval", "getattr", "Path.write_text",
                                  "inside-metadata"])
def test_malicious_metadata_never_runs(tmp_path, name):
    folder = plain(tmp_path / "ck")
    (folder / ".metadata").write_bytes(pickle.dumps(_payloads(tmp_path)[name]))
    with pytest.raises(checkpoint.CheckpointError, match="refusing to load|does not hold|not a valid") as e:
        sources.read(folder)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ran").exists()


def test_the_allowed_classes_are_those_dcp_save_writes(tmp_path):
    """Every class a real save's .metadata names (flashdist's save and plain dcp.save) is allowed, and the
    allowed list holds nothing else than DCP's metadata types, sizes, layouts, an ordered dict and paths."""
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for folder in (saved(tmp_path / "flashdist"), plain(tmp_path / "plain")):
        with open(folder / ".metadata", "rb") as f:
            Recording(f).load()
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert seen - dtypes <= dcp_files._ALLOWED, seen - dtypes - dcp_files._ALLOWED
    for module, name in dcp_files._ALLOWED:
        assert module.split(".")[0] in ("torch", "collections", "pathlib"), module
        if module == "pathlib._local" and not hasattr(pathlib, "_local"):
            continue  # where Python 3.13 pickles pathlib's classes from
        obj = getattr(__import__(module, fromlist=[name]), name)
        assert not isinstance(obj, type) or not issubclass(obj, (dcp.StorageReader, dcp.StorageWriter)), name
    assert len(dcp_files._ALLOWED) <= 20  # not whole module namespaces
