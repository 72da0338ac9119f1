"""How the fused step is launched: one immutable value, passed to each launch or set as the process default.

``LaunchConfig`` holds every knob of a launch (block sizes, programs, prefetch, registers, the exact or
approximate variant); a launch that is given none uses ``current()``, which is ``DEFAULT`` unless a caller
swapped it for a while with ``using``. Launch plans are cached per configuration
(``flashdist.kernels.triton.plans``). The defaults come from sweeps of the kernel on an H200; the
measurements are in docs/benchmarks.md. This module imports neither triton nor the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass


def exact_from_env() -> bool:
    """``FLASHDIST_EXACT``: ``1`` or unset for IEEE division and square root, ``0`` for the GPU's approximate
    ones (see ``LaunchConfig.exact``)."""
    value = os.environ.get("FLASHDIST_EXACT", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"flashdist: FLASHDIST_EXACT must be 0 (approximate division and sqrt on the GPU) or 1 "
                         f"(IEEE, the default), got {value!r}")
    return value == "1"


def _power_of_two(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True)
class KernelLaunch:
    """How one of FlashMuon's elementwise kernels is launched (a field of ``LaunchConfig``); checked when made.
    The prefetch uses ``LaunchConfig.prefetch_ahead`` and ``prefetch_level``."""

    groups: int
    """Groups of 32 values per block (a power of two)."""
    blocks: int = 1
    """Consecutive blocks per program."""
    warps: int = 4
    """Warps per program (a power of two)."""
    prefetch: bool = False
    """Ask the cache for a program's next block while it computes the current one (compiled kernels only, and
    where ``LaunchConfig.prefetch`` is True)."""
    max_registers: int | None = None
    """Registers per thread (None: the compiler's choice)."""
    tile_cols: int = 32
    """``muon_apply_transposed`` only: a block is a tile of ``groups * 32 // tile_cols`` rows and ``tile_cols``
    columns of the parameter (a power of two from 2, the rho split's pairs of columns, to ``groups * 32``): the
    parameter's and rho's values are consecutive along a tile's rows, the update's along its columns."""

    def __post_init__(self):
        # limits: a block of at most 2^20 values (Triton's largest), a program of at most 1,024 threads, and
        # block counts that stay int32 in the kernel
        for name, least, most in (("groups", 1, 1 << 15), ("warps", 1, 32), ("tile_cols", 2, None)):
            value, most = getattr(self, name), most or self.groups * 32
            if not _power_of_two(value) or not least <= value <= most:
                raise ValueError(f"flashdist: KernelLaunch.{name} must be a power of two from {least} to {most}, "
                                 f"got {value!r}")
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or not 1 <= self.blocks <= 1 << 20:
            raise ValueError(f"flashdist: KernelLaunch.blocks must be an int from 1 to {1 << 20}, got {self.blocks!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"flashdist: KernelLaunch.prefetch must be a bool, got {self.prefetch!r}")
        registers = self.max_registers
        if registers is not None and (not isinstance(registers, int) or isinstance(registers, bool) or registers < 1):
            raise ValueError(f"flashdist: KernelLaunch.max_registers must be None or a positive int, got {registers!r}")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Launch configuration of the fused step. Every field is checked when the value is made."""

    exact: bool = True
    """IEEE division and square root (bitwise equal to the eager reference on CUDA), or, when False, the GPU's
    approximate ones in the update's division, the companding division of the new first moment and the square
    root (``div.approx.f32`` and ``sqrt.approx.f32``, flushing subnormals). The approximate variant moves a
    code by at most one step near a rounding boundary and a master weight by a few fp32 ulps of the update
    (docs/method.md states the bound, tests/test_gpu.py checks it). The interpreter computes IEEE results in
    both variants. ``DEFAULT`` takes it from the environment variable ``FLASHDIST_EXACT``."""
    large_numel: int = 1 << 26
    """Tensors with at least this many elements get a launch of their own (a launch costs tens of
    microseconds of host time, so only embedding-sized ones); smaller ones share the table launch."""
    table_groups: int = 8
    """Groups of 32 slots per block in the table launch (a power of two)."""
    table_blocks: int = 8
    """Consecutive blocks of one tensor per program of the table launch (fewer: shorter tails at the end of a
    launch; more: the program's setup paid over more blocks)."""
    large_groups: int = 8
    """Groups of 32 slots per block in a per-tensor launch (a power of two)."""
    large_blocks: int = 8
    """Consecutive blocks per program of a per-tensor launch."""
    num_warps: int = 1
    """Warps per program (a power of two). One warp: no barrier couples warps (the scale stores and the skip
    count convert layouts through shared memory, which with several warps means block-wide barriers)."""
    prefetch: bool = True
    """Ask the cache for a program's next block while it computes the current one (compiled kernels only);
    False turns it off in FlashMuon's kernels too."""
    prefetch_ahead: int = 1
    """Blocks ahead of the current one that the prefetch asks for."""
    prefetch_level: int = 2
    """The cache level the prefetch fills: 2 (L2) or 1 (the program's SM's L1, and L2)."""
    max_registers: int | None = None
    """Registers per thread the compiler may use in every launch (None: ``exact_max_registers`` or
    ``approx_max_registers`` with 8-bit moments on the default layout, the compiler's choice elsewhere); fewer
    let more warps share an SM."""
    exact_max_registers: int | None = 72
    """The register cap of the exact variant with 8-bit moments on the default layout (``default_layout``)
    when ``max_registers`` is None: FlashAdamW's step at 70 registers instead of 94, 28 warps an SM instead
    of 21, no spills. Other layouts compile at the compiler's choice (under this cap they spill)."""
    approx_max_registers: int | None = 88
    """The register cap of the approximate variant with 8-bit moments on the default layout when
    ``max_registers`` is None."""
    muon_momentum: KernelLaunch = KernelLaunch(groups=16, blocks=4, warps=1, prefetch=True)
    """How FlashMuon's momentum kernel (phase 1, ``kernels/triton/muon.py``) is launched."""
    muon_apply: KernelLaunch = KernelLaunch(groups=16, blocks=1, warps=4, prefetch=False)
    """How FlashMuon's weight-update kernel (phase 3) is launched."""
    muon_apply_transposed: KernelLaunch = KernelLaunch(groups=16, blocks=1, warps=4)
    """How the weight-update kernel is launched on a tall matrix, whose orthogonalized update is the transpose
    of a contiguous one: tiles of ``groups`` rows and 32 columns (no prefetch)."""
    plan_cache_size: int = 256
    """Launch plans of this configuration kept in the cache: a few per optimizer call site (one per bucket of
    step count and layout), and gradient release steps each batch of FSDP2 groups with a call of its own
    (with ``bucket_mb=0`` an 8B Llama makes 33 batches, two layouts each)."""

    def __post_init__(self):
        for name in ("table_groups", "large_groups", "num_warps"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"flashdist: LaunchConfig.{name} must be a power of two, got {getattr(self, name)!r}")
        for name in ("large_numel", "table_blocks", "large_blocks", "prefetch_ahead", "plan_cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"flashdist: LaunchConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_registers", "exact_max_registers", "approx_max_registers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"flashdist: LaunchConfig.{name} must be None or a positive int, got {value!r}")
        for name in ("muon_momentum", "muon_apply", "muon_apply_transposed"):
            if not isinstance(getattr(self, name), KernelLaunch):
                raise ValueError(f"flashdist: LaunchConfig.{name} must be a KernelLaunch, got {getattr(self, name)!r}")
        if self.prefetch_level not in (1, 2):
            raise ValueError(f"flashdist: LaunchConfig.prefetch_level must be 1 or 2, got {self.prefetch_level!r}")
        for name in ("exact", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"flashdist: LaunchConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "LaunchConfig":
        """A copy with ``changes`` (field names), checked like a new value."""
        return dataclasses.replace(self, **changes)

    def compile_options(self, quantized: bool = True, default_layout: bool = True) -> dict:
        """The compiler options of a launch on 8-bit (or fp32) moments, on the default layout (see
        ``default_layout``) or another: warps per program, no FMA contraction (the reference's products and
        sums stay separate), and the register cap when one applies."""
        options = dict(num_warps=self.num_warps, enable_fp_fusion=False)
        if self.max_registers is not None or not quantized or not default_layout:
            cap = self.max_registers
        else:
            cap = self.exact_max_registers if self.exact else self.approx_max_registers
        if cap is not None:
            options["maxnreg"] = cap
        return options


def default_layout(flags: dict) -> bool:
    """Whether a launch with the kernel's constexpr ``flags`` has the default layout, the one the register caps
    (``LaunchConfig.exact_max_registers``, ``approx_max_registers``) were measured on and compile under without
    spilling: bf16 parameters and gradients with int8 rho, rows of whole groups at 16-byte aligned addresses,
    companded moments and Adam's one-branch division (``FAST_UPDATE``). Under the exact cap other layouts
    (int16 or no rho, fp16 or fp32 parameters, rows that end inside a group, unaligned views, linear moments)
    spill, under the approximate one rows that end inside a group and unaligned views do
    (tests/test_kernel_compiles.py compiles both sides)."""
    return (flags.get("P_KIND") == 0 and flags.get("G_KIND") == 0 and flags.get("RHO_KIND") == 1
            and bool(flags.get("ALIGNED")) and bool(flags.get("ALIGN16")) and bool(flags.get("COMPANDED"))
            and (flags.get("ALGO") != 0 or bool(flags.get("FAST_UPDATE"))))


DEFAULT = LaunchConfig(exact=exact_from_env())
"""The launch configuration of this process, with ``exact`` read once from ``FLASHDIST_EXACT`` at import."""

_current = DEFAULT


def current() -> LaunchConfig:
    """The configuration of launches that are given none: ``DEFAULT``, or the one ``using`` set."""
    return _current


@contextlib.contextmanager
def using(config: LaunchConfig) -> Iterator[LaunchConfig]:
    """Make ``config`` the configuration of launches given none (the optimizers' steps) inside the ``with``
    block, for benchmarks and tests that step an optimizer; the previous one is restored on exit."""
    global _current
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"flashdist: using() takes a LaunchConfig, got {type(config).__name__}")
    previous, _current = _current, config
    try:
        yield config
    finally:
        _current = previous
