"""What flashdist wrote, told by file type and header, never by name alone; and the few file-system calls that
publish a write without following a planted symbolic link.

- :func:`sniff` says what a regular file starts like (a flashdist shard, a zip (torch), a pickle (DCP
  metadata), a safetensors file, a JSON object, an empty file). It never follows a symbolic link, never opens
  a FIFO or a device (so it never blocks), and reads at most 64 bytes (a JSON file: at most 1 MiB).
- :func:`unrecognised` lists the entries of a folder that are not files a DCP checkpoint (``dcp``), a
  Hugging Face export (``hf``) or a save in progress (``partial=True``) holds, each checked by its header:
  a user's ``notes.distcp/`` folder, a ``.metadata`` link or a ``config.json`` that is not JSON is
  unrecognised, so nothing deletes or replaces it.
- :func:`exchange` swaps two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so a replaced output's
  path always holds the old or the new output; :func:`umask` and :func:`publish_mode` give a finished output
  the modes ``open``/``mkdir`` give under the user's umask.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import stat
from pathlib import Path

from .dcp_files import SHARD_MAGIC

_JSON_LIMIT = 1 << 20
_PICKLE = re.compile(rb"\x80[\x02-\x05]")

# entry name -> the headers it may have, complete / while being written (an empty file: created, not yet written)
_DCP = [(re.compile(r"\.metadata|__\d+\.metadata"), {"pickle"}, {"pickle", "empty"}),
        (re.compile(r"\.metadata\.tmp"), None, {"pickle", "empty"}),
        (re.compile(r"__\d+_\d+\.distcp"), {"shard", "zip", "empty"}, {"shard", "zip", "empty"})]
_HF = [(re.compile(r"model(-\d+-of-\d+)?\.safetensors"), {"safetensors"}, {"safetensors", "empty"}),
       (re.compile(r"model\.safetensors\.index\.json|config\.json|generation_config\.json"), {"json"},
        {"json", "empty"})]
_SAVE_MARKERS = {".flashdist-writing", ".flashdist-writing.new"}  # empty lock files of a save in progress


def sniff(path: Path) -> str | None:
    """"shard", "zip", "pickle", "safetensors", "json", "empty", or None (not a regular file, unreadable, or
    none of these)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size == 0:
            return "empty"
        head = os.pread(fd, 64, 0)
        if head.startswith(SHARD_MAGIC):
            return "shard"
        if head.startswith(b"PK\x03\x04"):
            return "zip"
        if _PICKLE.match(head):
            return "pickle"
        if len(head) > 8 and head[8:9] == b"{" and 8 + int.from_bytes(head[:8], "little") <= info.st_size:
            return "safetensors"
        if head.lstrip()[:1] == b"{" and info.st_size <= _JSON_LIMIT:
            try:
                return "json" if isinstance(json.loads(os.pread(fd, _JSON_LIMIT, 0)), dict) else None
            except ValueError:
                return None
        return None
    except OSError:
        return None
    finally:
        os.close(fd)


def _expected(name: str, kind: str, partial: bool) -> set[str] | None:
    for pattern, complete, writing in (_DCP if kind == "dcp" else _HF):
        if pattern.fullmatch(name):
            return writing if partial else complete
    return None


def unrecognised(folder: Path, kind: str, *, partial: bool = False) -> list[str]:
    """The sorted names in ``folder`` that are not files of a ``kind`` ("dcp" or "hf") output as flashdist writes
    them (``partial``: while it is being written, empty files and a save's lock files included), by header.
    Raises OSError when ``folder`` cannot be listed."""
    bad = []
    for name in sorted(os.listdir(folder)):
        if partial and name in _SAVE_MARKERS:
            found = sniff(folder / name)
            if found == "empty":
                continue
            bad.append(name)
            continue
        allowed = _expected(name, kind, partial)
        if allowed is None or sniff(folder / name) not in allowed:
            bad.append(name)
    return bad


def is_plain_dir(path: Path) -> bool:
    """A directory that is not a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def lexists(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except OSError:
        return False


def umask() -> int:
    """This process's umask (read without changing it where Linux shows it, else by setting and restoring it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_mode(path: Path, *, directory: bool) -> None:
    """Give a finished temporary output (created private) the mode ``mkdir``/``open`` give under the umask:
    0777 & ~umask for a folder, 0666 & ~umask for a file."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask(), follow_symlinks=False)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (both must exist); False where the system or the file system
    cannot (then the caller falls back to two renames)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018 - glibc 2.28 or later
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class Leftover:
    """One thing a killed save, convert or export left beside its destination, and what a clean-up does with it:
    "remove", "restore" (an earlier output moved aside, put back at the destination) or "keep" (``reason``)."""

    def __init__(self, path: Path, what: str, action: str, reason: str = ""):
        self.path, self.what, self.action, self.reason = path, what, action, reason

    def __repr__(self) -> str:
        return f"Leftover({str(self.path)!r}, {self.what!r}, {self.action!r}, {self.reason!r})"

    def line(self, dry_run: bool) -> str:
        """One line for ``flashdist clean``."""
        if self.action == "keep":
            return f"kept      {self.path}: {self.what}; {self.reason}"
        verb = {"remove": ("would remove", "removed"), "restore": ("would restore", "restored")}[self.action]
        return f"{verb[0] if dry_run else verb[1]:<9} {self.path}: {self.what}"
