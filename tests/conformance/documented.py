"""The refused cells a user can read about: the cell patterns of docs/integrations.md's table "Cells that are
not paths", which a refused cell of the matrix must match (test_matrix.py's test_cell)."""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


@functools.cache
def documented_patterns() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(pattern, the client/engine paths it excepts) for each cell pattern of the table's first column; a bare
    stage name completes the row's first pattern (`lightning/*/*/save`, `export-fp32` ->
    `lightning/*/*/export-fp32`)."""
    text = DOCS.read_text()
    table = text[text.index("Cells that are not paths"):].split("\n\n")[1]
    patterns = []
    for row in table.splitlines()[2:]:  # past the header and its rule
        named, _, excepted = row.split("|")[1].partition(" except ")
        names = re.findall(r"`([^`]+)`", named)
        exceptions = tuple(f"{path}/*" for path in re.findall(r"`([^`]+)`", excepted))
        patterns += [(name if "/" in name else f"{names[0].rsplit('/', 1)[0]}/{name}", exceptions) for name in names]
    return tuple(patterns)


def refusal_documented(cell: str) -> bool:
    return any(fnmatch.fnmatchcase(cell, pattern) and not any(fnmatch.fnmatchcase(cell, e) for e in exceptions)
               for pattern, exceptions in documented_patterns())
