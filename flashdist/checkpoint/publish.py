"""The atomic publish of a checkpoint folder: rank 0's side of ``save`` (:class:`Claim`) and the reader's side
(:func:`resolve`).

- Atomic: a save writes into a temporary folder of its own, ``PATH.tmp-<id>`` (a fresh id per save, agreed
  by all ranks), and once every rank has finished moves it into place (``PATH`` -> ``PATH.old``,
  ``PATH.tmp-<id>`` -> ``PATH``, then ``PATH.old`` is removed). A job killed at any moment leaves the last
  good checkpoint loadable: :func:`resolve` falls back to ``PATH.old`` in the instant between the two renames.
- Concurrent saves never mix: each writes its own folder, and the renames happen under an exclusive
  ``flock`` on ``PATH.flashdist-lock``, so the last save to finish wins whole. A crashed save's folder is
  recognised (its writer's lock is gone) and removed by a later save; a load never looks at it.
- Never destroys what it did not write: a regular file at ``PATH``, a symbolic link, or a folder holding
  anything but DCP files is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: saves are not serialised (docs/checkpoints.md)
    fcntl = None  # type: ignore[assignment]

from .dcp_files import SAVE_ID_PREFIX, new_save_id
from .errors import CheckpointError, CheckpointWriteError


_LOCK_SUFFIX = ".flashdist-lock"  # a name no user file is likely to have: the lock file is removed after use
_WRITING = ".flashdist-writing"  # held (flock) by a live save in its temporary folder; removed at the commit
_DCP_NAME = re.compile(r"(__\d+)?\.metadata(\.tmp)?|.*\.distcp")  # what DCP's FileSystemWriter writes
_warned_no_flock = False


def temp_folder(path: Path, save_id: str) -> Path:
    """The temporary folder that the save ``save_id`` to ``path`` writes into before it is moved into place."""
    return path.with_name(f"{path.name}.tmp-{save_id.removeprefix(SAVE_ID_PREFIX)}")


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


class Claim:
    """Rank 0's side of one save: the checks, the temporary folder and its lock (``Claim(path)``), the renames
    (:meth:`commit`, once every rank has written its shards) and the clean-up (:meth:`release`, always)."""

    def __init__(self, path: Path):
        self.path = path
        self.save_id = new_save_id()
        self.tmp = temp_folder(path, self.save_id)
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

