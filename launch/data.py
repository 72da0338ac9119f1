"""The training corpus: the Python standard library's own source files, read as bytes.

Every machine with Python has it, so training needs no download. Byte-level: the vocabulary is the 256
byte values. The split is by file and deterministic (a CRC of the file's path relative to the stdlib
root): about 1 file in 20 is validation, the same files on every machine with the same Python version.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import torch

VOCAB = 256
_SKIP = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    root = stdlib_root()
    return [f for f in sorted(root.rglob("*.py")) if not _SKIP.intersection(f.relative_to(root).parts)]


def load_corpus(max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, description) as uint8 tensors; files joined with a NUL separator."""
    root = stdlib_root()
    train, val = bytearray(), bytearray()
    n_files = [0, 0]
    for f in stdlib_files():
        is_val = zlib.crc32(str(f.relative_to(root)).encode()) % 20 == 0
        target = val if is_val else train
        if max_bytes is not None and not is_val and len(train) >= max_bytes:
            continue
        target += f.read_bytes() + b"\0"
        n_files[is_val] += 1
    info = {"root": str(root), "train_files": n_files[0], "val_files": n_files[1], "train_bytes": len(train),
            "val_bytes": len(val)}
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), info


def batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows: inputs (batch, seq_len) and next-byte targets, as int64."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]
