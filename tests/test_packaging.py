"""The package as users install it: the wheel and the sdist hold every file flashdist needs at run time, and
the wheel installed into a fresh environment, away from the checkout, trains, checkpoints and runs its CLI
(tests/smoke/installed.py)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def runtime_files() -> set[str]:
    """Every file of the flashdist package in the checkout (sources, C++ sources and headers, data), bytecode
    caches aside: what an installed flashdist must hold."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "flashdist").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The wheel and sdist built by setuptools from a copy of the files a fresh clone has (no build/ or
    egg-info of an earlier build to leak files in)."""
    folder = tmp_path_factory.mktemp("dist")
    src = folder / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "flashdist", src / "flashdist", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = folder / "out"
    code = ("from setuptools import build_meta as b; import sys; out = sys.argv[1]; "  # (setuptools rewrites argv)
            "print(b.build_wheel(out)); print(b.build_sdist(out))")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, check=True, capture_output=True, timeout=300)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def test_wheel_holds_every_runtime_file(dist):
    with zipfile.ZipFile(dist["wheel"]) as z:
        names = {n for n in z.namelist() if n.startswith("flashdist/")}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    missing = runtime_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}: add their pattern to [tool.setuptools.package-data]"
    assert names == runtime_files(), f"the wheel holds files the checkout has not: {sorted(names - runtime_files())}"
    assert "flashdist = flashdist.cli:main" in entry_points


def test_sdist_holds_every_runtime_file(dist):
    with tarfile.open(dist["sdist"]) as t:
        top = t.getnames()[0].split("/")[0]
        names = {n[len(top) + 1:] for n in t.getnames() if n.startswith(f"{top}/flashdist/")}
    names = {n for n in names if "." in Path(n).name}  # files, not folders
    missing = runtime_files() - names
    assert not missing, f"the sdist lacks {sorted(missing)}"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(dist, tmp_path):
    """The wheel installed with pip into a fresh virtual environment that sees this environment's torch (and
    the rest of its dependencies) through a path entry, but not the checkout nor its editable install
    (the .pth files of a path entry are not run). Run from an empty folder with a fresh C++ build folder, so
    both extensions are compiled from the installed sources."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    dependencies = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (_site_packages(python) / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    # without the checkout on PYTHONPATH: pip would take its flashdist.egg-info (an editable install's) for
    # flashdist installed, and install nothing
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(dist["wheel"])], check=True, timeout=300, env=env)
    run_in = tmp_path / "elsewhere"
    run_in.mkdir()
    env["FLASHDIST_CPU_BUILD_DIR"] = str(tmp_path / "cpu-build")
    out = subprocess.run([str(python), str(ROOT / "tests" / "smoke" / "installed.py"), "--source", str(ROOT)],
                         cwd=run_in, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installed flashdist: ok" in out.stdout
    print(out.stdout)
