"""The `flashdist` command run in this process: exit status, stdout and stderr."""

from __future__ import annotations

import contextlib
import io

from flashdist.cli import main


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()
