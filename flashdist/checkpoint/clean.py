"""``flashdist clean PATH``: list, and remove or put back, what killed saves, converts and exports left beside
``PATH``. Every save, convert and export does the same for its own destination before it writes; this is the
command for a path nothing will write again.

What is touched: dead temporary folders of saves (``PATH.tmp-<id>``), a ``PATH.old`` (put back at ``PATH``
when ``PATH`` is missing, removed otherwise), dead temporary outputs of ``convert``/``export``
(``.PATH.<random>.tmp``) and a previous output moved aside (``.PATH.<random>.old``, put back likewise). A
leftover is dead when no live writer holds its lock (flock); one is removed only when its files are recognised
by their headers as flashdist's (:mod:`flashdist.checkpoint.ownership`). Anything else is listed as kept,
with the reason, and left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from .output import output_leftovers
from .ownership import Leftover
from .publish import save_leftovers


def clean(path: str | os.PathLike, *, dry_run: bool = False) -> list[Leftover]:
    """The leftovers beside ``path`` (see the module's docstring), each with its action ("remove", "restore",
    "keep"); the actions are carried out unless ``dry_run``."""
    path = Path(path)
    return save_leftovers(path, apply=not dry_run) + output_leftovers(path, apply=not dry_run)
