"""What every test folder shares: where the Triton interpreter cases run.

Cases marked ``interpreted`` need Triton interpreted in the process that runs them (tests/_interpreter.py). Where
it is not (triton was imported compiled first, or CUDA is present), they run in a child process, reported here by
the module's test marked ``interpreter_runner`` (which asserts the child's pass count), and are deselected in
this process rather than skipped; where it is, the runner is deselected and the cases run here.
"""

from __future__ import annotations

import sys


def _interpreted_here(item) -> bool:
    flag = getattr(getattr(item, "module", None), "IN_PROCESS", None)  # a module's own, stricter check
    if flag is None:
        interpreter = sys.modules.get("_interpreter")
        flag = bool(interpreter and interpreter.IN_PROCESS)
    return flag


def pytest_collection_modifyitems(config, items):
    keep, moved = [], []
    for item in items:
        runs_elsewhere = ((item.get_closest_marker("interpreted") and not _interpreted_here(item))
                          or (item.get_closest_marker("interpreter_runner") and _interpreted_here(item)))
        (moved if runs_elsewhere else keep).append(item)
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = keep
