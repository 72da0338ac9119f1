"""The refused cells a user can read about: the cell patterns of docs/integrations.md's table "Cells that are
not paths", which a refused cell of the matrix must match (test_matrix.py's test_cell)."""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path

from conformance_table import STAGES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


@functools.cache
def documented_patterns() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(pattern, the client/engine paths it excepts) for each cell pattern of the table's first column. A short
    pattern (no ``/``) repeats the one before it with its stage or optimizer replaced (`lightning/*/*/save`,
    `export-fp32` -> `lightning/*/*/export-fp32`; `deepspeed/*/FlashSGD/resume-other`, `FlashLion` ->
    `deepspeed/*/FlashLion/resume-other`); a client/engine pair after "except" names an exception."""
    text = DOCS.read_text()
    table = text[text.index("Cells that are not paths"):].split("\n\n")[1]
    patterns = []
    for row in table.splitlines()[2:]:  # past the header and its rule
        named, _, excepted = row.split("|")[1].partition(" except ")
        exceptions = tuple(f"{path}/*" for path in re.findall(r"`([^`]+)`", excepted))
        last = None
        for name in re.findall(r"`([^`]+)`", named):
            if "/" not in name and last is not None:
                parts = last.split("/")
                parts[3 if name in STAGES else 2] = name
                name = "/".join(parts)
            last = name
            patterns.append((name, exceptions))
    return tuple(patterns)


def refusal_documented(cell: str) -> bool:
    return any(fnmatch.fnmatchcase(cell, pattern) and not any(fnmatch.fnmatchcase(cell, e) for e in exceptions)
               for pattern, exceptions in documented_patterns())
