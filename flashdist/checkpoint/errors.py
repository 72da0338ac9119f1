"""The errors of flashdist's checkpoint code, and the one-line summary of any error met while reading or
writing a checkpoint (``flashdist.checkpoint.dcp`` re-exports them)."""

from __future__ import annotations

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
