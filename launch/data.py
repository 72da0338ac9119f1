"""The training corpus: the Python sources of the running interpreter's installed packages and standard library,
read as bytes.

Every machine with Python has such sources, so training needs no download. Byte-level: the vocabulary is the 256
byte values. The text is the packages' own source code, under each package's own license, used here only as
training bytes for a loss measurement; nothing derived from it is shipped.

The files are listed in sorted order (the standard library first, then each site-packages directory), named by a
key ``<root label>/<path relative to that root>``. The split is by file and deterministic: a file is validation
when the CRC-32 of its key is 0 mod 20 (about 1 file in 20), so the same key lands on the same side on every
machine. Files are joined with a NUL byte between them.

The full corpus (hundreds of MB) is built once into ``<cache dir>/<listing digest>/`` (train.bin, val.bin,
manifest.json) and memory-mapped, so several training processes on one machine share one copy in the page cache.
The listing digest (a SHA-256 of every key and size, in order) names what was trained on; the manifest adds the
file counts, byte counts and a SHA-256 of each .bin file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

VOCAB = 256
VAL_EVERY = 20  # 1 file in 20 (by key hash) is validation
_SKIP = {"site-packages", "dist-packages", "__pycache__"}
_FORMAT = 1  # bump when the layout of train.bin / val.bin changes


def source_roots() -> list[tuple[str, Path]]:
    """(label, directory) of the running interpreter's sources: the standard library, then each distinct
    site-packages directory (purelib, platlib)."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and all(p.resolve() != r.resolve() for _, r in roots):
            roots.append(("site-packages" if key == "purelib" else "platlib", p))
    return roots


def list_sources(roots: list[tuple[str, Path]] | None = None) -> list[tuple[str, Path, int]]:
    """(key, path, size) of every ``*.py`` file under ``roots``, sorted by key. Inside a root, directories named
    site-packages, dist-packages or __pycache__ are skipped (the standard library's own site-packages is listed
    as a root of its own); symbolic links to directories are not followed."""
    out = []
    for label, root in roots if roots is not None else source_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP]
            for name in filenames:
                if name.endswith(".py"):
                    path = Path(dirpath) / name
                    try:
                        size = path.stat().st_size
                    except OSError:  # a dangling link
                        continue
                    out.append((f"{label}/{path.relative_to(root).as_posix()}", path, size))
    out.sort(key=lambda e: e[0])
    return out


def is_validation(key: str) -> bool:
    return zlib.crc32(key.encode()) % VAL_EVERY == 0


def listing_digest(listing: list[tuple[str, Path, int]]) -> str:
    h = hashlib.sha256(f"format {_FORMAT}\n".encode())
    for key, _, size in listing:
        h.update(f"{key}\t{size}\n".encode())
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes() + b"\0"
    except OSError:
        return None


def build_corpus(cache_dir: str | os.PathLike, roots: list[tuple[str, Path]] | None = None) -> Path:
    """The directory holding train.bin, val.bin and manifest.json for the current sources, built when it is not
    in ``cache_dir`` yet (streamed file by file, never whole in memory). A finished build is renamed into place
    in one step, so processes that build at the same time each get a complete copy and one of them wins."""
    listing = list_sources(roots)
    if not listing:
        raise FileNotFoundError(f"no *.py files under {[str(r) for _, r in roots or source_roots()]}: the corpus "
                                "needs the Python sources of an installed interpreter")
    digest = listing_digest(listing)
    final = Path(cache_dir) / digest[:16]
    if (final / "manifest.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=final.parent))
    try:
        counts = {"train": [0, 0], "val": [0, 0]}  # files, bytes
        sha = {"train": hashlib.sha256(), "val": hashlib.sha256()}
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval, \
                ThreadPoolExecutor(8) as pool:  # tens of thousands of small files: reads overlap, order is kept
            for start in range(0, len(listing), 1024):
                chunk = listing[start:start + 1024]
                for (key, _, _), data in zip(chunk, pool.map(_read, [path for _, path, _ in chunk])):
                    if data is None:  # unreadable: counted by neither side, the digest still names the listing
                        continue
                    split = "val" if is_validation(key) else "train"
                    (fval if split == "val" else ftrain).write(data)
                    sha[split].update(data)
                    counts[split][0] += 1
                    counts[split][1] += len(data)
        manifest = {
            "description": "Python sources (*.py) of the installed packages and standard library, as bytes; "
                           "each file under its own package's license, used only as training bytes",
            "roots": {label: str(root) for label, root in (roots or source_roots())},
            "listing_sha256": digest, "listed_files": len(listing),
            "split": f"validation = crc32(key) % {VAL_EVERY} == 0, key = '<root label>/<relative path>'",
            "train_files": counts["train"][0], "train_bytes": counts["train"][1],
            "val_files": counts["val"][0], "val_bytes": counts["val"][1],
            "train_sha256": sha["train"].hexdigest(), "val_sha256": sha["val"].hexdigest(),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: its copy has the same listing
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _mapped(path: Path) -> torch.Tensor:
    size = path.stat().st_size
    # MAP_PRIVATE: read lazily, pages shared through the page cache by every process that maps the file
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def load_corpus(max_bytes: int | None = None, cache_dir: str | os.PathLike = "runs/corpus",
                roots: list[tuple[str, Path]] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, manifest) as uint8 tensors.

    Without ``max_bytes``: the whole corpus, built once into ``cache_dir`` and memory-mapped. With it (small
    test and CPU runs): the first files of the sorted listing, read into memory until the training side holds
    ``max_bytes`` (and the validation side a twentieth of it), not cached."""
    if max_bytes is None:
        where = build_corpus(cache_dir, roots)
        manifest = json.loads((where / "manifest.json").read_text())
        manifest["dir"] = str(where)
        return _mapped(where / "train.bin"), _mapped(where / "val.bin"), manifest
    train, val = bytearray(), bytearray()
    n_files = [0, 0]
    for key, path, _ in list_sources(roots):
        is_val = is_validation(key)
        target = val if is_val else train
        if len(target) >= (max_bytes // VAL_EVERY if is_val else max_bytes):
            if len(train) >= max_bytes and len(val) >= max_bytes // VAL_EVERY:
                break
            continue
        target += path.read_bytes() + b"\0"
        n_files[is_val] += 1
    manifest = {"description": f"the first {max_bytes} training bytes of the sorted listing (a capped corpus)",
                "roots": {label: str(root) for label, root in (roots or source_roots())},
                "train_files": n_files[0], "val_files": n_files[1], "train_bytes": len(train), "val_bytes": len(val)}
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), manifest


def batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random windows: inputs (batch, seq_len) and next-byte targets, as int64."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]
