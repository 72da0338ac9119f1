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


def assert_inspect_reads_structure_like_whole(path, monkeypatch) -> None:
    """`flashdist inspect PATH` (text and --json) and the source it opens (plain data, every tensor's route,
    shape and dtype, in order), reading the structure only, equal those of the same checkpoint read whole
    (every tensor's data: the reference), and the structure holds no tensor data but scalars."""
    from flashdist.checkpoint import convert as C
    from flashdist.checkpoint import sources as S

    whole, structure = S.open_source(path), S.open_source(path, structure=True)
    assert structure.rest == whole.rest
    assert list(structure.specs.items()) == list(whole.specs.items())
    assert all(t.is_meta or t.dim() == 0 for t in structure.tensors.values())
    assert not any(t.is_meta for t in whole.tensors.values())
    got = [run_cli("inspect", path), run_cli("inspect", path, "--json")]
    with monkeypatch.context() as m:  # the reference: open_source as inspect called it before, every tensor read
        m.setattr(C, "open_source", lambda p, structure=False, **kw: S.open_source(p, **kw))
        want = [run_cli("inspect", path), run_cli("inspect", path, "--json")]
    assert got == want and got[0][0] == 0, (got, want)
