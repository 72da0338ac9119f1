"""The errors of flashdist's checkpoint code, and the one-line summary of any error met while reading or
writing a checkpoint (``flashdist.checkpoint.dcp`` re-exports them)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model and optimizer (nothing was changed), or a save
    refused before it wrote anything."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save that failed while writing (read-only folder, full disk, I/O error): the checkpoint at the path,
    if any, is unchanged and this save's temporary folder was removed."""


def error_summary(e: BaseException) -> str:
    """One line for an error met while reading or writing a checkpoint: DCP's first failing rank's own error
    rather than its traceback dump; flashdist's own message whole, anything else's first line (at most 300
    characters); without a leading ``flashdist: `` (the caller adds its own)."""
    if isinstance(e, CheckpointException):  # the first rank's own error, not DCP's traceback dump
        failures = [e.failures[rank] for rank in sorted(e.failures)]
        if failures:
            e = failures[0]
            if isinstance(e, tuple):  # DCP's WRAPPED_EXCEPTION: (exception, traceback summary)
                e = e[0]
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    if not text:
        return type(e).__name__
    return (text[0] if isinstance(e, CheckpointError) else text[0][:300]).removeprefix("flashdist: ")


_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
         errno.EFBIG: "the file size limit was reached"}
# what torch's zip writer (PyTorchStreamWriter) says when a write of its own failed
_TORCH_WRITER = re.compile(r"unexpected pos|PytorchStreamWriter failed|file write failed")
_NEARLY_FULL = 1 << 20


def _causes(e: BaseException):
    seen = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]


def write_failure(e: BaseException, where: str | os.PathLike | None = None) -> str:
    """One line for a failed write that says what happened: "the disk is full (No space left on device)", the
    quota or the file size limit, also when torch's zip writer reports it as ``unexpected pos 704 vs 598``
    (then the free space of ``where``'s file system decides); any other error as :func:`error_summary`."""
    for cause in _causes(e):
        if isinstance(cause, OSError) and cause.errno in _FULL:
            return f"{_FULL[cause.errno]} ({os.strerror(cause.errno)})"
    text = error_summary(e)
    if not _TORCH_WRITER.search(text):
        return text
    free = None
    if where is not None:
        try:
            free = shutil.disk_usage(Path(where)).free
        except OSError:
            pass
    if free is not None and free < _NEARLY_FULL:
        return f"the disk is full ({free} bytes free; torch's zip writer: {text[:120]})"
    return f"the write failed (disk full or a file size limit?; torch's zip writer: {text[:120]})"
