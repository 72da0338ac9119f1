"""Compile the fused step kernel for an NVIDIA GPU without one, and count what it compiles to.

    python launch/bench/kernel_sass.py                 # a table: instructions and registers per specialisation
    python launch/bench/kernel_sass.py --arch 90 --json out.json
    python launch/bench/kernel_sass.py --muon          # FlashMuon's two elementwise kernels

Triton compiles for a target given by compute capability, and its wheel ships ptxas and cuobjdump, so the
table launch of flashdist/kernels/triton/programs.py is compiled here for sm_90 (H100/H200) in every update
(Adam, SGD, Lion) and layout, and its SASS is counted: static instructions of the kernel (the per-element
work of one block is about that divided by the values each thread holds: 8 at 8 groups of 32 per block
and 1 warp) and registers per thread (occupancy: 65,536 registers per SM). This catches a kernel that no longer
compiles (the interpreter tests run the kernel as Python, not through the compiler) and shows the effect of a
change on the instruction budget before any GPU time is spent. Needs triton on Linux; TRITON_INTERPRET must
not be set (it replaces the compiler).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flashdist.kernels.scalars import KERNEL_SLOTS

SCALARS = tuple(f"sc{k}" for k in range(KERNEL_SLOTS))  # the kernel's fp32 scalar arguments
ALGOS = {"adam": 0, "sgd": 1, "lion": 2}


def specialisations():
    """(name, constexpr overrides) of the table kernel: each update with 8-bit and fp32 moments, exact and
    approximate, bf16 parameters with int8 rho; SGD without momentum, a capturable step, and FlashAdamW's exact
    step on int16 rho and on fp32 parameters too."""
    for (algo, code), quantized, exact in itertools.product(ALGOS.items(), (True, False), (True, False)):
        yield (f"{algo}-{'q8' if quantized else 'fp32m'}-{'exact' if exact else 'approx'}",
               dict(ALGO=code, HAS_M=True, QUANTIZED=quantized, EXACT=exact, COMPILED=True))
    yield "sgd-no-momentum-exact", dict(ALGO=1, HAS_M=False, QUANTIZED=False, EXACT=True, COMPILED=True)
    # a capturable step: the scalars read from device memory
    yield "adam-q8-exact-capturable", dict(ALGO=0, HAS_M=True, QUANTIZED=True, EXACT=True, COMPILED=True, SCALARS=True)
    # layouts other than the default, which compile without the exact variant's register cap
    yield "adam-q8-exact-int16-rho", dict(ALGO=0, HAS_M=True, QUANTIZED=True, EXACT=True, COMPILED=True, RHO_KIND=2,
                                          RHO_LOG2=15)
    yield "adam-q8-exact-fp32-params", dict(ALGO=0, HAS_M=True, QUANTIZED=True, EXACT=True, COMPILED=True, P_KIND=2,
                                            G_KIND=2, RHO_KIND=0)


def compile_one(overrides: dict, arch: int = 90, groups: int | None = None, config=None) -> dict:
    """Compile the table kernel with ``overrides`` of its constexprs under launch configuration ``config``
    (default: ``flashdist.kernels.triton.DEFAULT``; its ``exact`` is the specialisation's EXACT)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashdist.kernels.triton import DEFAULT, programs
    from flashdist.kernels.triton.config import default_layout
    from flashdist.kernels.triton.prefetch import prefetch_slots

    config = config or DEFAULT
    consts = dict(P_KIND=0, G_KIND=0, RHO_KIND=1, QUANTIZED=True, ALIGNED=True, ALIGN16=True, COMPANDED=True,
                  DECOUPLED=True, COUNT_SKIPPED=True, ALGO=0, HAS_M=True, NESTEROV=False, EXACT=True,
                  COMPILED=True, FAST_UPDATE=True, RHO_LOG2=7, GROUPS=groups or config.table_groups,
                  AHEAD=config.prefetch_ahead, LEVEL=config.prefetch_level, SCALARS=False)
    consts.update(overrides)
    config = config.replace(exact=consts["EXACT"])
    consts["PREFETCH"] = prefetch_slots(consts, consts["GROUPS"], config)  # as a launch on the GPU sets it
    options = config.compile_options(consts["QUANTIZED"], default_layout(consts))  # as fused.py chooses them
    signature = {"work_ptr": "*i32", "tensors_ptr": "*i64", "table_ptr": "*fp32", "skipped_ptr": "*i32",
                 "scalars_ptr": "*fp32", **dict.fromkeys(SCALARS, "fp32"), **dict.fromkeys(consts, "constexpr")}
    compiled = triton.compile(ASTSource(programs.table_kernel, signature, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options=options)
    return count(compiled)


def muon_specialisations():
    """(name, kernel, non-constexpr signature, constexprs, KernelLaunch field) of FlashMuon's two kernels
    (``flashdist/kernels/triton/muon.py``): the momentum update on companded 8-bit codes (also reading the
    gradient's address from a cell, as a captured step does) and on an fp32 buffer; the weight update of bf16
    parameters with int8 rho (also with the learning rate read on the device, and of a tall matrix whose update
    is a transpose) and of fp32 parameters."""
    momentum = dict(g_ptr="*i16", m_ptr="*u8", ms_ptr="*i16", u_ptr="*i16", table_ptr="*fp32", numel="i32",
                    ngroups="i32", cols="i32", gpr="i32", nblocks="i32", buf_coef="fp32", nest_coef="fp32")
    base = dict(G_KIND=0, QUANTIZED=True, COMPANDED=True, ALIGNED=True, BUF_SMALL=False, NESTEROV=True,
                NEST_SMALL=False, COMPILED=True, G_CELL=False)
    yield "muon-momentum-q8", "_momentum_kernel", momentum, base, "muon_momentum"
    yield "muon-momentum-q8-cell", "_momentum_kernel", dict(momentum, g_ptr="*i64"), dict(base, G_CELL=True), \
        "muon_momentum"
    yield "muon-momentum-fp32m", "_momentum_kernel", dict(momentum, m_ptr="*fp32", ms_ptr="*fp32"), \
        dict(base, QUANTIZED=False), "muon_momentum"
    apply = dict(p_ptr="*i16", rho_ptr="*i8", o_ptr="*i16", skipped_ptr="*i32", numel="i32", nblocks="i32",
                 decay="fp32", alpha="fp32", rows="i32", cols="i32", tiles_per_row="i32", lr_ptr="*fp32",
                 wd_bits="i64", ratio_bits="i64")
    base = dict(P_KIND=0, RHO_KIND=1, RHO_LOG2=7, COUNT=True, LR_PTR=False, COMPILED=True, TRANSPOSED=False,
                TILE_COLS=32)  # (a transposed launch's own: compile_muon)
    yield "muon-apply-bf16-int8", "_apply_kernel", apply, base, "muon_apply"
    yield "muon-apply-bf16-int8-transposed", "_apply_kernel", apply, dict(base, TRANSPOSED=True), \
        "muon_apply_transposed"
    yield "muon-apply-bf16-int8-device-lr", "_apply_kernel", apply, dict(base, LR_PTR=True), "muon_apply"
    yield "muon-apply-fp32", "_apply_kernel", dict(apply, p_ptr="*fp32", rho_ptr="*fp32"), \
        dict(base, P_KIND=2, RHO_KIND=0), "muon_apply"


def compile_muon(kernel: str, signature: dict, consts: dict, field: str, arch: int = 90, config=None) -> dict:
    """Compile one of FlashMuon's kernels as ``config``'s ``field`` launches it (default: ``DEFAULT``), with
    the constexprs and options ``muon.launch_options`` gives a launch on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashdist.kernels.triton import DEFAULT, muon, using

    config = config or DEFAULT
    launch = getattr(config, field)
    slots = launch.groups * 32
    if kernel == "_momentum_kernel":
        lines = muon.momentum_lines(slots, 4 if consts["G_KIND"] == 2 else 2, consts["QUANTIZED"], consts["ALIGNED"])
    else:
        lines = muon.apply_lines(slots, 4 if consts["P_KIND"] == 2 else 2, consts["RHO_KIND"], consts["TRANSPOSED"])
    with using(config):
        options = muon.launch_options(launch, lines)
    consts = dict(consts, **{k: options.pop(k) for k in ("GROUPS", "BLOCKS", "PREFETCH", "AHEAD", "LEVEL")})
    if consts.get("TRANSPOSED"):
        consts["TILE_COLS"] = launch.tile_cols
    fn = getattr(muon, kernel)
    # the pointers and sizes are 16-divisible, as a launch on the GPU specialises them for Llama's shapes
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v.startswith("*") or v == "i32"}
    compiled = triton.compile(ASTSource(fn, {**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                                        attrs=attrs), target=GPUTarget("cuda", arch, 32), options=options)
    return {"prefetch_slots": consts["PREFETCH"], **count(compiled)}


def count(compiled) -> dict:
    """Static SASS instructions, shared-memory instructions, registers and stack bytes of a compiled kernel."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return {"instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/", sass)),
            # values moved between layouts through shared memory (the kernel itself keeps none there)
            "shared": len(re.findall(r"\b(?:LDS|STS|LDSM|STSM|BAR)\b", sass)),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spills": int(m.group(1)) if (m := re.search(r"STACK:(\d+)", usage)) else 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: sm_90)")
    ap.add_argument("--only", nargs="*", help="names of the specialisations to compile (default: all)")
    ap.add_argument("--json", help="write the results to this path")
    ap.add_argument("--muon", action="store_true", help="FlashMuon's two kernels instead of the fused step")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_sass.py compiles the kernel: unset TRITON_INTERPRET")
    rows = []
    if args.muon:
        for name, *spec in muon_specialisations():
            if not args.only or name in args.only:
                rows.append(dict(name=name, **compile_muon(*spec, arch=args.arch)))
                print(json.dumps(rows[-1]), flush=True)
    for name, overrides in specialisations() if not args.muon else ():
        if args.only and name not in args.only:
            continue
        rows.append(dict(name=name, **compile_one(overrides, args.arch)))
        print(json.dumps(rows[-1]), flush=True)
    import triton

    print(f"\nsm_{args.arch}, triton {triton.__version__}\n")
    print("| specialisation | SASS instructions | registers | stack bytes | shared-memory instructions |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['instructions']} | {r['registers']} | {r['spills']} | {r['shared']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
