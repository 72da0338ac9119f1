"""Fused CPU steps (FlashAdam(W), FlashSGD(W), FlashLion; FlashMuon's momentum and weight-update phases, one
tensor per call): one multi-threaded, vectorised C++ pass per call.

The arithmetic is that of ``flashdist.kernels.reference``, operation for operation in fp32, so the result is
bitwise the reference's (NaN payloads aside: a NaN written to a parameter is a NaN, not necessarily the same
one). The source, ``step.cpp`` beside this file (with ``avx512.h``), is compiled at the first CPU step with
``torch.utils.cpp_extension`` (g++ or the compiler torch finds, and ninja; about a minute) into a cache folder
keyed by the source, flags, torch and Python versions and the CPU, so later processes load it at once:
``$FLASHDIST_CPU_BUILD_DIR``, else ``$XDG_CACHE_HOME/flashdist`` or ``~/.cache/flashdist``. It is built
with ``-march=native`` (the build runs on the machine that uses it) and ``-ffp-contract=off``, without fast
math. Where the build machine has AVX-512 (F, BW, VL), the 8-bit steps on bf16 + rho or fp32 parameters run an
explicitly vectorised path that keeps each quantization group in registers from its codes to its new codes
(``avx512.h``; same operations, same bits; with AVX-512 VBMI the companded first moment's values are looked up
in a table of the same fp32 values instead of divided); where it has AVX2 but not AVX-512 (AMD Zen 1-3, Intel
client cores), the same blocks in 8-lane vectors (``avx2.h``). ``vector_isa()`` says which the build has.
Where it cannot be built (no compiler, no ninja) the steps fall back to the reference with one warning.
``FLASHDIST_CPU_KERNEL=0`` turns the fused step off.

Concurrent first steps (several ranks of one job) build once: builders take an ``fcntl`` lock in the build
folder, which the system releases when a builder dies, so a build killed midway never blocks a later one
(torch's own lock file left behind by such a build is removed by the next builder).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from ..scalars import AdamScalars, LionScalars, MuonScalars, SGDScalars

SOURCE = Path(__file__).with_name("step.cpp")  # includes avx512.h beside it
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 900.0  # waiting longer than this on another process's build falls back to the reference



def enabled() -> bool:
    """False when ``FLASHDIST_CPU_KERNEL=0`` (the eager reference runs on CPU)."""
    return os.environ.get("FLASHDIST_CPU_KERNEL", "1") != "0"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_key(source: Path = SOURCE) -> str:
    """Hash of everything the library built from ``source`` depends on (the headers beside it included)."""
    source = Path(source)
    h = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, sys.version, platform.machine(), _cpu_id()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def build_dir(source: Path = SOURCE) -> Path:
    root = os.environ.get("FLASHDIST_CPU_BUILD_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "flashdist")
    return Path(root) / f"cpu-{build_key(source)}"


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(source: Path = SOURCE):
    import fcntl  # POSIX: elsewhere the build fails here and the reference runs

    from torch.utils import cpp_extension

    key = build_key(source)
    name = f"flashdist_cpu_{key}"
    folder = build_dir(source)
    done = folder / "built"  # written once a build has loaded: its library is complete
    library = folder / f"{name}.so"
    if done.exists() and library.exists():
        return _import(library, name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as lock:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building in {folder} for {BUILD_TIMEOUT_S:.0f} s")
                time.sleep(0.2)
        try:
            if done.exists() and library.exists():
                return _import(library, name)
            # Holding the flock, no live builder is in this folder: a lock file of torch's is stale.
            (folder / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(CFLAGS),
                                        extra_ldflags=list(LDFLAGS), build_directory=str(folder), verbose=False)
            done.write_text(key)
            return module
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class BuiltOnce:
    """A library compiled from ``source`` (``_build``) at its first use, in one thread of the process; None,
    after one warning naming ``what`` could not be built and what happens instead (``otherwise``), where it
    cannot be built (no compiler, no ninja, a failed build)."""

    def __init__(self, source: Path, what: str, otherwise: str):
        self.source, self.what, self.otherwise = source, what, otherwise
        self.module = None
        self.failed: str | None = None  # why the build failed
        self.lock = threading.Lock()

    def load(self):
        if self.module is not None or self.failed is not None:
            return self.module
        with self.lock:
            if self.module is None and self.failed is None:
                try:
                    self.module = _build(self.source)
                except Exception as e:  # the callers have a slower way that works everywhere
                    self.failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                    warnings.warn(f"flashdist: {self.what} could not be built ({self.failed}); {self.otherwise}",
                                  RuntimeWarning, stacklevel=4)
        return self.module


_STEP = BuiltOnce(SOURCE, "the fused CPU step", "CPU steps use the eager reference (slower). Install g++ and "
                  "ninja, or set FLASHDIST_CPU_KERNEL=0 to silence this.")


def load():
    """The compiled module, building it on first use; None (after one warning) where it cannot be built."""
    return _STEP.load()


def available() -> bool:
    """True when the fused CPU step is enabled and built (building it now if needed)."""
    return enabled() and load() is not None


def build_error() -> str | None:
    """Why the last build failed, or None."""
    return _STEP.failed


def build_from(source: str | Path):
    """The step compiled from another ``step.cpp`` (an earlier version, to time against), built into its own
    cache folder like the package's own; raises what the build raises. The optimizers keep using the
    package's step except inside ``using(module)``."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such step source; pass the path of a step.cpp")
    return _build(source)


@contextlib.contextmanager
def using(module):
    """Run the CPU steps of this block with ``module`` (from ``build_from``) in place of the package's step,
    in this process; the package's step is back after it."""
    load()
    saved = _STEP.module
    with _STEP.lock:
        _STEP.module = module
    try:
        yield module
    finally:
        with _STEP.lock:
            _STEP.module = saved


def vector_isa() -> str | None:
    """The instruction set of the built step's explicitly vectorised paths ("avx512" or "avx2": the 8-bit steps
    on bf16 + rho or fp32 parameters), "" where the build machine has neither (the block code, which the
    compiler vectorises, runs alone), or None when the fused step is not built."""
    module = load() if enabled() else None
    return module.vector_isa() if module is not None else None


def _count(skipped: torch.Tensor | None, n: int) -> bool:
    if n < 0:
        return False
    if skipped is not None and n:
        skipped.add_(n)
    return True


def adam_step(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, rhos, *, cols,
              scalars: AdamScalars, companded: bool, skipped: torch.Tensor | None) -> bool:
    """``flash_adam``'s step on CPU tensors. False (nothing changed) when the kernel is not built or the tensors
    are not ones it handles (contiguous CPU tensors of the documented dtypes); the caller then runs the
    reference."""
    module = load()
    if module is None:
        return False
    sc = scalars
    quantized = exp_avg_scales is not None
    n = module.adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                         list(exp_avg_scales) if quantized else [],
                         list(exp_avg_sq_scales) if quantized else [], list(rhos) if rhos is not None else [],
                         list(cols) if quantized else [], quantized, sc.beta1, sc.beta2, sc.one_minus_beta1,
                         sc.one_minus_beta2, sc.eps, sc.weight_decay, sc.decay, sc.step_size,
                         sc.inv_bias_correction2_sqrt, sc.decoupled, companded)
    return _count(skipped, n)


def sgd_step(params, grads, momentum_buffers, momentum_scales, rhos, *, cols, scalars: SGDScalars,
             companded: bool, skipped: torch.Tensor | None) -> bool:
    """``flash_sgd``'s step on CPU tensors; returns as ``adam_step``."""
    module = load()
    if module is None:
        return False
    sc = scalars
    momentum = momentum_buffers is not None
    quantized = momentum and momentum_scales is not None
    n = module.sgd_step(list(params), list(grads), list(momentum_buffers) if momentum else [],
                        list(momentum_scales) if quantized else [], list(rhos) if rhos is not None else [],
                        list(cols) if quantized else [], momentum, quantized, sc.momentum_decay, sc.momentum_gain,
                        sc.momentum, sc.weight_decay, sc.decay, sc.lr, sc.decoupled, sc.nesterov, companded)
    return _count(skipped, n)


def lion_step(params, grads, exp_avgs, exp_avg_scales, rhos, *, cols, scalars: LionScalars, companded: bool,
              skipped: torch.Tensor | None) -> bool:
    """``flash_lion``'s step on CPU tensors; returns as ``adam_step``."""
    module = load()
    if module is None:
        return False
    sc = scalars
    quantized = exp_avg_scales is not None
    n = module.lion_step(list(params), list(grads), list(exp_avgs), list(exp_avg_scales) if quantized else [],
                         list(rhos) if rhos is not None else [], list(cols) if quantized else [], quantized,
                         sc.beta1, sc.beta2, sc.one_minus_beta1, sc.one_minus_beta2, sc.decay, sc.lr, companded)
    return _count(skipped, n)


def muon_momentum(grad, momentum_buffer, momentum_scales, *, cols: int | None, scalars: MuonScalars,
                  companded: bool) -> torch.Tensor | None:
    """``reference.muon_momentum_`` on CPU tensors, with the update returned as bf16 (as ``flash_muon`` sends
    it); None (nothing changed) where the kernel is not built or the tensors are not ones it handles."""
    module = load()
    if module is None:
        return None
    sc = scalars
    quantized = momentum_scales is not None
    update = torch.empty(grad.shape, dtype=torch.bfloat16)
    buf_small, nest_small = sc.buffer_weight < 0.5, sc.momentum < 0.5
    done = module.muon_momentum(update, grad, momentum_buffer, momentum_scales if quantized else update,
                                int(cols or 0), quantized, sc.buffer_weight if buf_small else sc.buffer_weight - 1.0,
                                sc.momentum if nest_small else sc.momentum - 1.0, buf_small, sc.nesterov, nest_small,
                                companded)
    return update if done else None


def muon_apply(param, rho, ortho, *, scalars: MuonScalars, skipped: torch.Tensor | None) -> bool:
    """``reference.muon_apply_`` on CPU tensors; returns as ``adam_step``."""
    module = load()
    if module is None:
        return False
    n = module.muon_apply(param, ortho, [rho] if rho is not None else [], scalars.decay, scalars.alpha)
    return _count(skipped, n)
