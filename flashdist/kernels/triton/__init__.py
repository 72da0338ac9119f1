"""The fused Triton step (``fused``) and its launch configuration.

Importing this package imports no triton: ``LaunchConfig``, ``using``, ``clear_plans`` and ``cached_plans``
are host-side; the kernel is imported with ``flashdist.kernels.triton.fused``.
"""

from .config import DEFAULT, KernelLaunch, LaunchConfig, current, using
from .plans import cached_plans, clear_plans

__all__ = ["DEFAULT", "KernelLaunch", "LaunchConfig", "cached_plans", "clear_plans", "current", "using"]
