"""A save, convert or export killed (SIGKILL) at any phase leaves the destination holding the old or the new
output, and the next run on that path, or ``flashdist clean``, leaves nothing else beside it.

Each kill runs in a child from a forkserver that has torch and flashdist imported: the child patches one
function to SIGKILL itself at a chosen call, then saves or runs the command."""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

import flashdist
from flashdist import checkpoint
from flashdist.checkpoint import convert as C
from flashdist.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
_context = None


def _ctx():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "flashdist", "flashdist.cli"])
    return _context


def cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).to(torch.bfloat16)


def _save(path: Path, n: int) -> None:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(n)
    checkpoint.save(path, model, flashdist.FlashAdamW(model.parameters()), extra={"n": n})


def _saved_n(path: Path) -> int:
    model = _model()
    return checkpoint.load(path, model, flashdist.FlashAdamW(model.parameters()))["n"]


def _die_at(target: str, match: str, when: str) -> None:
    """Patch ``target`` ("module:attr" or "module:Class.attr") to SIGKILL this process before or after its first
    call whose first argument contains ``match``."""
    module, _, attr = target.partition(":")
    owner = importlib.import_module(module)
    *outer, name = attr.split(".")
    for part in outer:
        owner = getattr(owner, part)
    real = getattr(owner, name)

    def dying(*args, **kwargs):
        hit = match in str(args[0] if args else "")
        if hit and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, name, dying)


def _child(kill: tuple[str, str, str], op: str, args: tuple, patches: tuple) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for target, value in patches:
        module, _, attr = target.partition(":")
        setattr(importlib.import_module(module), attr, value)
    _die_at(*kill)
    if op == "save":
        _save(*args)
    else:
        main(list(args))
    os._exit(3)  # the kill point was never reached


def _run_killed(kill, op, *args, patches=()) -> None:
    proc = _ctx().Process(target=_child, args=(kill, op, tuple(map(str, args)) if op == "cli" else args, patches))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, f"the child was not killed at {kill} (exit {proc.exitcode})"


def _never_exchange(a, b) -> bool:
    return False


# ----- save -------------------------------------------------------------------------------------------------

SAVE_PHASES = {
    "writing-shards": ("flashdist.checkpoint.dcp_files:_ShardStream.finish", "", "before"),
    "before-commit": ("flashdist.checkpoint.publish:Claim.commit", "", "before"),
    "writer-lock-unlinked": ("os:unlink", ".flashdist-writing", "after"),
    "between-renames": ("os:replace", "ck", "after"),  # PATH -> PATH.old done, PATH.tmp-<id> -> PATH not
    "before-old-removed": ("os:replace", ".tmp-", "after"),
}
SAVED_AFTER = {"writing-shards": 1, "before-commit": 1, "writer-lock-unlinked": 1, "between-renames": 1,
               "before-old-removed": 2}


@pytest.mark.parametrize("phase", list(SAVE_PHASES))
def test_killed_save_leaves_old_or_new_and_clean_leaves_nothing_else(tmp_path, phase):
    path = tmp_path / "ck"
    _save(path, 1)
    kill = SAVE_PHASES[phase]
    if phase == "between-renames":  # the first os.replace whose source is PATH itself
        kill = ("os:replace", str(path), "after")
    _run_killed(kill, "save", path, 2)
    assert _saved_n(path) == SAVED_AFTER[phase]  # loadable at once (PATH, or PATH.old between the renames)
    rc, out, err = cli("clean", path, "--dry-run")
    assert rc == 0 and err == "" and "would " in out, (out, err)
    left = sorted(os.listdir(tmp_path))
    rc, out, err = cli("clean", path)
    assert rc == 0 and ("removed" in out or "restored" in out), (out, err)
    assert sorted(os.listdir(tmp_path)) == ["ck"], (left, out)
    assert _saved_n(path) == SAVED_AFTER[phase]


@pytest.mark.parametrize("phase", ["writer-lock-unlinked", "between-renames"])
def test_next_save_removes_what_a_killed_save_left(tmp_path, phase):
    """The issue's case: a full PATH.tmp-<id> left by a save killed after its writer lock went survived later
    saves. The next save removes it (and puts PATH.old back first where PATH is missing)."""
    path = tmp_path / "ck"
    _save(path, 1)
    kill = SAVE_PHASES[phase] if phase != "between-renames" else ("os:replace", str(path), "after")
    _run_killed(kill, "save", path, 2)
    assert len(os.listdir(tmp_path)) > 1
    _save(path, 3)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and _saved_n(path) == 3


# ----- convert / export -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "ck"
    _save(path, 1)
    return path


CLI_PHASES = {  # name: (kill point, patches)
    "writing": (("flashdist.checkpoint.output:_check_fetched", "", "after"), ()),
    "before-swap": (("flashdist.checkpoint.output:_into_place", "", "before"), ()),
    "after-swap": (("flashdist.checkpoint.output:_remove", ".tmp", "before"), ()),
    "aside-between-renames": (("os:rename", ".tmp", "before"),
                              (("flashdist.checkpoint.output:exchange", _never_exchange),)),
    "aside-before-removed": (("flashdist.checkpoint.output:_remove", ".old", "before"),
                             (("flashdist.checkpoint.output:exchange", _never_exchange),)),
}


def _format(dst: Path) -> str:
    return C.inspect(dst)["optimizer_format"]


@pytest.mark.parametrize("phase,next_run", [(phase, "clean") for phase in CLI_PHASES]
                         + [("after-swap", "convert"), ("aside-between-renames", "convert")])
def test_killed_convert_force_leaves_old_or_new_and_next_run_tidies(source, tmp_path, phase, next_run):
    dst = tmp_path / "out"
    assert cli("convert", source, dst, "--to", "dcp")[0] == 0  # the old output: portable
    assert _format(dst) in ("portable", None)
    old = _format(dst)
    kill, patches = CLI_PHASES[phase]
    _run_killed(kill, "cli", "convert", source, dst, "--to", "dcp", "--format", "compressed", "--force",
                patches=patches)
    if phase != "aside-between-renames":  # the one instant with nothing at the destination (no atomic swap)
        assert _format(dst) in (old, "compressed")
    if next_run == "clean":
        rc, out, err = cli("clean", dst)
        assert rc == 0 and err == "", err
        assert sorted(os.listdir(tmp_path)) == ["out"], out
        assert _format(dst) in (old, "compressed")
    else:
        rc, _, err = cli("convert", source, dst, "--to", "dcp", "--format", "compressed", "--force")
        assert rc == 0, err
        assert sorted(os.listdir(tmp_path)) == ["out"] and _format(dst) == "compressed"


@pytest.mark.parametrize("args", [("convert", "--to", "torch"), ("convert", "--to", "safetensors"), ("export",),
                                  ("export", "--hf")], ids=["torch", "safetensors", "export", "export-hf"])
def test_killed_write_of_each_kind_is_cleaned(source, tmp_path, args):
    dst = tmp_path / "out"
    _run_killed(("flashdist.checkpoint.output:_check_fetched", "", "after"), "cli", args[0], source, dst,
                *args[1:])
    left = sorted(os.listdir(tmp_path))
    assert len(left) == 1 and left[0].startswith(".out.") and left[0].endswith(".tmp"), left
    rc, out, _ = cli("clean", dst, "--dry-run")
    assert rc == 0 and out.startswith("would remove") and sorted(os.listdir(tmp_path)) == left
    rc, out, _ = cli(args[0], source, dst, *args[1:])  # the next run removes it, then writes
    assert rc == 0 and sorted(os.listdir(tmp_path)) == ["out"]
    assert cli("clean", dst)[1] == f"nothing to clean beside {dst}\n"
