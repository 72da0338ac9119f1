"""The atomic publish of a checkpoint folder: rank 0's side of ``save`` (:class:`Claim`), the reader's side
(:func:`resolve`) and the clean-up of what killed saves left (:func:`save_leftovers`).

- Atomic: a save writes into a temporary folder of its own, ``PATH.tmp-<id>`` (a fresh id per save, agreed
  by all ranks), and once every rank has finished moves it into place (``PATH`` -> ``PATH.old``,
  ``PATH.tmp-<id>`` -> ``PATH``, then ``PATH.old`` is removed). A job killed at any moment leaves the last
  good checkpoint loadable: :func:`resolve` falls back to ``PATH.old`` in the instant between the two renames.
- Concurrent saves never mix: each writes its own folder, and the renames happen under an exclusive
  ``flock`` on ``PATH.flashdist-lock``, so the last save to finish wins whole.
- Leftovers of killed saves are removed or recovered by the next save (or ``flashdist clean PATH``): under
  the same lock, which every save also holds while it creates its folder and the writer's lock in it, a
  ``PATH.tmp-<id>`` whose ``.flashdist-writing`` is not held (or is missing: the save died while
  committing) is dead and removed; a ``PATH.old`` is put back at ``PATH`` when ``PATH`` is missing, else
  removed. A folder holding anything a save does not write is never removed.
- Never destroys what it did not write: a regular file at ``PATH``, a symbolic link, or a folder holding
  anything but DCP files (each recognised by its header: :mod:`flashdist.checkpoint.ownership`) is refused
  before anything is written. Lock files are opened without following a symbolic link and refused unless
  they are regular files; everything is created under the user's umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: saves are not serialised (docs/checkpoints.md)
    fcntl = None  # type: ignore[assignment]

from .dcp_files import SAVE_ID_PREFIX, new_save_id
from .errors import CheckpointError, CheckpointWriteError
from .ownership import Leftover, is_plain_dir, lexists, unrecognised


_LOCK_SUFFIX = ".flashdist-lock"  # a name no user file is likely to have: the lock file is removed after use
_WRITING = ".flashdist-writing"  # held (flock) by a live save in its temporary folder; removed at the commit
_warned_no_flock = False


def temp_folder(path: Path, save_id: str) -> Path:
    """The temporary folder that the save ``save_id`` to ``path`` writes into before it is moved into place."""
    return path.with_name(f"{path.name}.tmp-{save_id.removeprefix(SAVE_ID_PREFIX)}")


def lock_file(path: Path) -> Path:
    return path.with_name(path.name + _LOCK_SUFFIX)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _check_target(path: Path) -> None:
    """Refuse a ``path`` (or a leftover ``PATH.old``) that a save would replace but that holds something a
    save did not write. Rank 0, before writing and again under the lock before the renames."""
    for target in (path, path.with_name(path.name + ".old")):
        what = "" if target == path else f" (left by an earlier save to {path.name}?)"
        if target.is_symlink():
            raise CheckpointError(f"flashdist: {target} is a symbolic link{what}; save to the folder it points to, "
                                  "or remove the link")
        if not lexists(target):
            continue
        if not is_plain_dir(target):
            raise CheckpointError(f"flashdist: {target} exists and is not a folder{what}; a checkpoint is a folder "
                                  "and saving would delete that file: choose another path or move the file")
        try:
            foreign = unrecognised(target, "dcp")
        except OSError as e:
            raise CheckpointWriteError(f"flashdist: cannot save checkpoint to {path}: cannot list {target}: "
                                       f"{e.strerror or e}") from None
        if foreign:
            raise CheckpointError(f"flashdist: {target} is a folder holding entries that are not part of a checkpoint "
                                  f"({_shown(foreign)}){what}; saving would delete them: choose another path or "
                                  "move them")


def flock(fd: int, flags: int) -> bool | None:
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


def open_lock(lock: Path, *, create: bool = True) -> int:
    """A file descriptor on the lock file ``lock`` (created, under the umask, if missing and ``create``),
    opened without following a symbolic link; refuses a link or anything but a regular file in one line."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0), 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"flashdist: the lock file {lock} is a symbolic link (not made by flashdist); "
                                  "remove it and retry") from None
        if e.errno == errno.EISDIR:
            raise CheckpointError(f"flashdist: the lock file {lock} is not a regular file (not made by flashdist); "
                                  "remove it and retry") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"flashdist: the lock file {lock} is not a regular file (not made by flashdist); "
                              "remove it and retry")
    return fd


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive flock on ``lock`` (created if missing, removed on release); yields False where the file
    system cannot lock. A process that dies holding it releases it, so a crashed save never blocks a later one."""
    while True:
        fd = open_lock(lock)
        locked = flock(fd, fcntl.LOCK_EX if fcntl else 0)
        if locked is None:
            break
        # the previous holder removes the file on release: a lock on a removed file guards nothing, retry
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield bool(locked)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def _writer_alive(folder: Path, can_lock: bool) -> bool | None:
    """Whether a live save holds ``folder``'s writer lock: True, False, or None when this file system cannot
    tell. Called under the commit lock, which every save holds while it creates its folder and that lock, so a
    folder without one belongs to a save that died while committing."""
    try:
        fd = os.open(folder / _WRITING, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False if can_lock else None
    try:
        got = flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if fcntl else 0)
        return None if got is None else not got
    finally:
        os.close(fd)


def _leftovers(path: Path, can_lock: bool, apply: bool) -> list[Leftover]:
    """The leftovers of killed saves to ``path``, removed or restored when ``apply``; under the commit lock."""
    found: list[Leftover] = []
    pattern = re.compile(re.escape(path.name) + r"\.tmp-[0-9a-f]{32}")
    try:
        names = sorted(os.listdir(path.parent))
    except FileNotFoundError:
        return found
    for name in names:
        if not pattern.fullmatch(name):
            continue
        folder = path.parent / name
        what = "the temporary folder of a save that did not finish"
        if not is_plain_dir(folder):
            found.append(Leftover(folder, "not a folder", "keep", "not written by flashdist: remove it yourself"))
            continue
        alive = _writer_alive(folder, can_lock)
        if alive:
            found.append(Leftover(folder, "the folder of a save in progress", "keep", "a live save is writing it"))
            continue
        try:
            foreign = unrecognised(folder, "dcp", partial=True)
        except OSError as e:
            foreign = [f"cannot list it: {e.strerror or e}"]
        if foreign:
            found.append(Leftover(folder, what, "keep", f"it holds entries flashdist does not write "
                                  f"({_shown(foreign)}): move them, then remove it yourself"))
        elif alive is None:
            found.append(Leftover(folder, what, "keep", "this file system cannot lock files, so a live save cannot "
                                  "be told from a dead one: remove it yourself when no save is running"))
        else:
            found.append(Leftover(folder, what, "remove"))
            if apply:
                shutil.rmtree(folder, ignore_errors=True)
    old = path.with_name(path.name + ".old")
    if is_plain_dir(old):
        try:
            foreign = unrecognised(old, "dcp")
        except OSError as e:
            foreign = [f"cannot list it: {e.strerror or e}"]
        if foreign or not os.path.lexists(old / ".metadata"):
            found.append(Leftover(old, "not a checkpoint", "keep", f"it holds entries flashdist does not write "
                                  f"({_shown(foreign) or 'no .metadata'}): move them, then remove it yourself"))
        elif not lexists(path):
            found.append(Leftover(old, f"the previous checkpoint, moved aside by a save killed before it put "
                                  f"the new one at {path.name}", "restore"))
            if apply:
                os.rename(old, path)
        else:
            found.append(Leftover(old, "the previous checkpoint, replaced by a newer one", "remove"))
            if apply:
                shutil.rmtree(old, ignore_errors=True)
    return found


def save_leftovers(path: str | os.PathLike, *, apply: bool) -> list[Leftover]:
    """What killed saves to ``path`` left (dead temporary folders, a ``PATH.old``), under the commit lock;
    removed (a ``PATH.old`` with no ``PATH``: restored) when ``apply``. Anything holding files a save does
    not write, or held by a live save, is listed with action "keep" and left alone."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    try:
        with _exclusive(lock_file(path)) as can_lock:
            return _leftovers(path, can_lock, apply)
    except OSError as e:
        if apply or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    return _leftovers(path, True, apply=False)  # a folder this process cannot write to: list only


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
            # under the commit lock: the leftovers of dead saves go, and no cleaner sees this folder before its
            # writer's lock is held
            with _exclusive(lock_file(path)) as can_lock:
                _leftovers(path, can_lock, apply=True)
                self.tmp.mkdir()
                self.fd = os.open(self.tmp / _WRITING, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
                flock(self.fd, fcntl.LOCK_EX if fcntl else 0)
        except CheckpointError:
            self.release()
            raise
        except OSError as e:
            self.release()
            raise CheckpointWriteError(f"flashdist: cannot save checkpoint to {path}: {e.strerror or e}"
                                       + (f" ({e.filename})" if e.filename else "") + "; nothing was written") from None

    def commit(self) -> None:
        path, old = self.path, self.path.with_name(self.path.name + ".old")
        try:
            with _exclusive(lock_file(path)):
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

