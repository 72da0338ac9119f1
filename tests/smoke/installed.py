"""flashdist used as a user installs it: run with the Python of an environment that has the wheel installed,
from a folder outside the checkout, so that nothing of the source tree is importable.

    python tests/smoke/installed.py [--source CHECKOUT] [--skip-build]

Checks, each in a few seconds once built:
- ``flashdist`` imports from the environment's site-packages (not from ``CHECKOUT``);
- a CPU step of FlashAdamW builds the fused C++ step from the installed ``step.cpp`` and headers
  (in ``$FLASHDIST_CPU_BUILD_DIR``; point it at an empty folder to make it build) and matches the reference
  bit for bit;
- the host helper that ``GraphedStep`` checks addresses with builds from the installed ``addresses.cpp``
  (and, with CUDA, a ``GraphedStep`` replays a step);
- a DCP checkpoint saved by FSDP2 on 2 gloo ranks loads back, equal;
- the ``flashdist`` console command inspects it.

``tests/test_packaging.py`` builds the wheel, installs it into a fresh environment and runs this script;
it also runs on its own against any installed flashdist. ``--skip-build`` leaves out the two C++ builds
(the version smoke on other torch releases: tests/smoke/versions.sh).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch


def check_import_location(source: Path | None) -> None:
    import flashdist

    where = Path(flashdist.__file__).resolve()
    if source is not None and (source / "flashdist").resolve() in where.parents:  # (an environment may sit
        # inside the checkout, .venv-versions/ say: only the checkout's own package counts)
        raise SystemExit(f"flashdist imported from the checkout ({where}), not from the installed package")
    prefix = Path(sys.prefix).resolve()
    if prefix not in where.parents:
        raise SystemExit(f"flashdist imported from {where}, outside this environment ({prefix})")
    print(f"flashdist {where.parent}")


def check_cpu_step() -> None:
    from flashdist import FlashAdamW
    from flashdist.kernels import cpu

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed build warns: fail here instead
        if not cpu.available():
            raise SystemExit(f"the fused CPU step did not build: {cpu.build_error()}")
    assert Path(cpu.SOURCE).resolve().is_relative_to(Path(sys.prefix).resolve()), cpu.SOURCE
    results = []
    for backend in ("cpu", "reference"):
        torch.manual_seed(0)
        model = torch.nn.Linear(96, 64).to(torch.bfloat16)
        opt = FlashAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
        for _ in range(3):
            model(torch.randn(8, 96, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()]
                       + [opt.state[p]["rho"].clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b), "the fused CPU step differs from the reference"
    print(f"CPU step: built in {cpu.build_dir()}, vector ISA {cpu.vector_isa()}, equal to the reference")


def check_host_helper() -> None:
    from flashdist.kernels import host

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        helpers = host.load()
    if helpers is None:
        raise SystemExit("the GraphedStep host helper did not build")
    params = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(3)]
    seen = torch.zeros(3, dtype=torch.int64)
    assert helpers.addresses_changed(params, False, seen) and not helpers.addresses_changed(params, False, seen)
    params[1].data = torch.zeros(4, 8)
    assert helpers.addresses_changed(params, False, seen) and seen[1] == params[1].data_ptr()
    print("GraphedStep host helper: built, sees a moved parameter")
    if torch.cuda.is_available():
        from flashdist import FlashAdamW, GraphedStep

        model = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
        opt = FlashAdamW(model.parameters(), lr=1e-3, capturable=True)
        step = GraphedStep(opt)
        for _ in range(4):
            model(torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)).float().mean().backward()
            step()
        assert step.replays >= 1, "GraphedStep never replayed"
        print(f"GraphedStep on CUDA: {step.captures} capture(s), {step.replays} replays")


def _rank(rank: int, world: int, store: str, ckpt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import flashdist
    from flashdist import FlashAdamW

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).to(torch.bfloat16)
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            return model, FlashAdamW(model.parameters(), lr=1e-2, backend="reference")

        model, opt = build()
        torch.manual_seed(1 + rank)
        for _ in range(2):
            model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        flashdist.checkpoint.save(ckpt, model, opt, extra={"step": 2})
        fresh, fresh_opt = build()
        extra = flashdist.checkpoint.load(ckpt, fresh, fresh_opt)
        assert extra["step"] == 2
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a.to_local(), b.to_local())
        for p, q in zip(model.parameters(), fresh.parameters()):
            for key, value in opt.state[p].items():
                other = fresh_opt.state[q][key]
                if isinstance(value, torch.Tensor):
                    local = getattr(value, "to_local", lambda: value)()
                    assert torch.equal(local, getattr(other, "to_local", lambda: other)()), key
    finally:
        dist.destroy_process_group()


def check_checkpoint_and_cli(folder: Path) -> None:
    import torch.multiprocessing as mp

    ckpt = folder / "ckpt"
    mp.start_processes(_rank, args=(2, str(folder / "store"), str(ckpt)), nprocs=2, join=True,
                       start_method="spawn")
    print("DCP: saved on 2 gloo ranks (FSDP2), loaded back equal")
    command = shutil.which("flashdist", path=str(Path(sys.executable).parent))
    if command is None:
        raise SystemExit(f"no flashdist console command in {Path(sys.executable).parent}")
    out = subprocess.run([command, "inspect", str(ckpt)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or "dcp" not in out.stdout or "saved world size" not in out.stdout:
        raise SystemExit(f"flashdist inspect failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    print(f"CLI: flashdist inspect: {' '.join(out.stdout.split()[:4])} ...")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="the checkout, which flashdist must not be imported from")
    parser.add_argument("--skip-build", action="store_true", help="leave out the two C++ builds")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    check_import_location(args.source)
    if not args.skip_build:
        check_cpu_step()
        check_host_helper()
    with tempfile.TemporaryDirectory() as folder:
        check_checkpoint_and_cli(Path(folder))
    print("installed flashdist: ok")


if __name__ == "__main__":
    main()
