"""The fused kernel compiles for sm_90 (H100/H200) in every specialisation, on this machine without a GPU.

The interpreter tests (test_triton_kernel.py) run the kernel as Python, which accepts code the compiler
rejects (a variable defined under a runtime branch, a non-constexpr condition). This compiles the table
launch with Triton's own toolchain (launch/bench/kernel_sass.py) and checks what occupancy depends on: no register
spills, and few enough registers for 4 programs of 4 warps per SM; and that no value of a block changes layout
through shared memory (each costs stores, loads and barriers in every block; tests/test_gpu.py checks the
same with the GPU machine's triton).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Found, not imported: importing triton here would fix this process to compiled mode before
# test_triton_kernel.py can switch it to the interpreter.
TRITON = importlib.util.find_spec("triton")


@pytest.mark.skipif(TRITON is None, reason="triton is not installed")
def test_every_specialisation_compiles_for_sm90(tmp_path):
    tools = Path(TRITON.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tools.exists():
        pytest.skip(f"this triton build ships no NVIDIA toolchain ({tools} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "kernel_sass.py"), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert len(rows) == 16
    for name, r in rows.items():
        assert r["instructions"] > 0 and r["spills"] == 0 and r["shared"] == 0, (name, r)
        assert r["registers"] <= 128, (name, r)  # 128 x 128 threads x 4 programs = 65,536 registers per SM
    # the exact variant on the default layout fits its register cap (the int16-rho and fp32-parameter steps,
    # which would spill under it, compile without it: no spills above)
    from flashdist.kernels.triton.config import DEFAULT

    for name in ("adam-q8-exact", "adam-q8-exact-capturable", "sgd-q8-exact", "lion-q8-exact"):
        assert rows[name]["registers"] <= DEFAULT.exact_max_registers, (name, rows[name])
    # reading the scalars from the device (a capturable step) costs a few loads per program, not per value
    assert rows["adam-q8-exact-capturable"]["instructions"] < rows["adam-q8-exact"]["instructions"] + 32
    # the exact variant pays for IEEE division and square root; the approximate one must not
    assert rows["adam-q8-approx"]["instructions"] < rows["adam-q8-exact"]["instructions"]


@pytest.mark.skipif(TRITON is None, reason="triton is not installed")
def test_muon_kernels_compile_for_sm90(tmp_path):
    """FlashMuon's two kernels as the default configuration launches them (the momentum update's prefetch and
    blocks per program included): they compile, spill nothing, and the momentum update keeps its values out of
    shared memory (the weight update's one use is the skip count's reduction, once per program)."""
    tools = Path(TRITON.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tools.exists():
        pytest.skip(f"this triton build ships no NVIDIA toolchain ({tools} is missing)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "kernel_sass.py"), "--muon", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert len(rows) == 7
    for name, r in rows.items():
        assert r["instructions"] > 0 and r["spills"] == 0, (name, r)
        if name.startswith("muon-momentum"):
            assert r["shared"] == 0, (name, r)
