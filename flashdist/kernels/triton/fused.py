"""Fused multi-tensor step in Triton (FlashAdam(W), FlashSGD(W), FlashLion): the CUDA path behind
``flashdist.functional``. This module holds the launchers; the kernel is in parts, one job each:

- ``bits``: bit-exact arithmetic helpers and constants (bf16 through its bits, IEEE division and square root
  at the cost of CUDA's fast paths, codes rounded by one addition);
- ``rho_bits``: rho's split and merge (``flashdist.quant.rho``) as integer arithmetic on bit patterns;
- ``step``: one block of one tensor, the whole update of Adam, SGD or Lion;
- ``prefetch``: the L2 prefetch of a program's next block;
- ``programs``: the two launch styles (a work table of small tensors, a launch per large tensor) and the
  loop over a program's blocks;
- ``plans``: host-side launch plans (buckets of one specialisation, device tables), cached per configuration;
- ``config``: ``LaunchConfig``, the immutable launch configuration.

Semantics. ``adam_step_multi`` does, on every tensor of its lists, exactly what ``reference.adam_step_``
does, operation by operation and with the same fp32 scalars (``sgd_step_multi`` and ``lion_step_multi``
likewise): under ``TRITON_INTERPRET=1`` the results are bitwise equal, and on CUDA too with
``LaunchConfig.exact`` (the default). To keep that promise on every backend the kernel moves bf16 through its
bits, divides and takes square roots as IEEE does (``bits``), is compiled with ``enable_fp_fusion=False`` so
that no ``a * b + c`` of the reference becomes an FMA, and computes what the reference computes exactly in
cheaper exact ways where it can (``rho_bits``, ``bits.code_bits``).

Each call makes one launch per bucket (``plans``). The kernel is bound by instruction issue, so its speed
follows the instructions each value costs: every value of a block stays in the layout of its loads (none
moves through shared memory; launch/bench/kernel_sass.py counts shared-memory instructions, and tests check it),
rho's split and merge of bf16 parameters are one integer add each, the exact variant's IEEE operations run
CUDA's fast paths without their per-value range checks, and codes are rounded by one addition. The
instruction counts, register use and timings are in docs/benchmarks.md.

Launch configuration. Every launcher takes ``config`` (a ``LaunchConfig``; None: ``config.current()``). The
names ``EXACT``, ``LARGE_NUMEL``, ``TABLE_GROUPS``, ... of this module read the current configuration's fields;
they cannot be set (pass a ``LaunchConfig`` instead).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence

import torch

from ...errors import CaptureRefused
from ..scalars import KERNEL_SLOTS, AdamScalars, DeviceScalars, LionScalars, SGDScalars
from .bits import ADAM, INTERPRETED, LION, SGD
from .config import LaunchConfig, current, default_layout
from . import plans
from .plans import build_plan, cache_for, keep_captured
from .prefetch import prefetch_slots
from .programs import table_kernel, tensor_kernel

__all__ = ["ADAM", "SGD", "LION", "LaunchConfig", "adam_step_multi", "sgd_step_multi", "lion_step_multi",
           "compile_options"]

# FAST_UPDATE's scalar range (see _step_multi)
_UPDATE_EPS_MIN = 2.0**-122
_UPDATE_SCALAR_MAX = 2.0**12

_data_ptr = torch.Tensor.data_ptr


def _step_multi(algo: int, params, grads, moments: list, scales: list | None, rhos, cols, scalars, *,
                companded: bool, decoupled: bool, nesterov: bool, skipped: torch.Tensor | None,
                config: LaunchConfig | None) -> None:
    """One step of update ``algo`` on every tensor of the lists: one launch per bucket (``plans``).
    ``scalars``: the update's ``AdamScalars``, ``SGDScalars`` or ``LionScalars``, or ``DeviceScalars`` (a
    capturable step: the launches read them from the device)."""
    if not params:
        return
    if config is None:
        config = current()
    elif not isinstance(config, LaunchConfig):
        raise TypeError(f"flashdist: config must be a LaunchConfig or None, got {type(config).__name__}")
    device = params[0].device
    quantized = scales is not None
    layout = (device, algo, len(moments), quantized, rhos[0].dtype if rhos is not None else None,
              list(cols) if quantized else None)
    param_ptrs = list(map(_data_ptr, params))
    grad_ptrs = list(map(_data_ptr, grads))
    # The first state list identifies the state (a replaced state tensor gets a new plan). Without any state
    # (SGD without momentum on parameters without rho) the parameters themselves are watched: a plan must
    # not outlive the tensors whose sizes its tables hold, since another tensor may take the same address.
    first_state = moments[0] if moments else (rhos if rhos is not None else params)
    cache = cache_for(config)
    plan = cache.find(layout, param_ptrs, first_state)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    on_device = isinstance(scalars, DeviceScalars)
    if capturing and (plan is None or grad_ptrs != plan.grad_ptrs):
        # A new plan or new gradient addresses copy tables from host memory: a captured copy would read that
        # memory again at every replay, after it was freed. Inside GraphedStep's capture (plans.collecting) a
        # capturable launch may take a plan for gradients elsewhere: GraphedStep points it at each replay's
        # gradients before the replay (Plan.retarget), and the capture itself runs nothing.
        if plan is None or not (on_device and plans.collecting() and plan.fits(grads, grad_ptrs)):
            raise CaptureRefused(
                "flashdist: the step is being captured in a CUDA graph, but its launch plan is "
                f"{'new' if plan is None else 'for gradients at other addresses'}; run one step with the same "
                "parameters, state and gradient tensors before capturing (a warm-up step, as torch.cuda.graphs "
                "requires)")
    elif plan is not None and grad_ptrs != plan.grad_ptrs and not plan.set_grads(grads, grad_ptrs):
        cache.discard(plan)
        plan = None
    if plan is None:
        plan = build_plan(config, layout, param_ptrs, params, grads, moments, scales, rhos, cols)
        states = [*moments, *(scales or [])]
        if rhos is not None:
            states.append(rhos)
        plan.watch(cache, first_state, states or [params])
        cache.add(plan)

    if skipped is not None and (skipped.dtype != torch.int32 or skipped.device != device):
        raise ValueError(f"flashdist: skipped must be an int32 tensor on {device}, got {skipped.dtype} on "
                         f"{skipped.device}")
    counter = plan.dummy if skipped is None else skipped
    if capturing:
        # a graph replays this plan's tables for as long as it lives: they must outlive the cache's use of them
        keep_captured(plan)
    elif device.type == "cuda":
        # the plan's device tables may have been allocated on another stream (gradient release steps on a
        # side stream): keep their memory from being reused there while this launch may still read them
        plan.used_on(torch.cuda.current_stream(device))
    # Adam's update divides 8-bit groups' scaled first moments (0, or magnitudes in [2^-48, 4)) by denominators
    # in [eps, 2^64 c2 + eps] (c2 = 1/sqrt(1 - beta2^t)): with these scalars the quotients lie in
    # [2^-125, 2^124], bits.div_normalized's range
    fast_update = (algo == ADAM and _UPDATE_EPS_MIN <= scalars.eps <= _UPDATE_SCALAR_MAX
                   and scalars.inv_bias_correction2_sqrt <= _UPDATE_SCALAR_MAX)
    if on_device and scalars.values.device != device:
        raise ValueError(f"flashdist: the device scalars are on {scalars.values.device}, the parameters on {device}")
    args = (0.0,) * KERNEL_SLOTS if on_device else scalars.kernel_args()
    values = scalars.values if on_device else plan.exp_avg_table  # (an fp32 tensor the launch does not read)
    for bucket in plan.buckets:
        flags = dict(bucket.flags, COMPANDED=companded, DECOUPLED=decoupled, COUNT_SKIPPED=skipped is not None,
                     ALGO=algo, HAS_M=bool(moments), NESTEROV=nesterov, EXACT=config.exact,
                     COMPILED=not INTERPRETED, FAST_UPDATE=fast_update, AHEAD=config.prefetch_ahead,
                     LEVEL=config.prefetch_level, SCALARS=on_device)
        flags.update(config.compile_options(bucket.flags["QUANTIZED"], default_layout(flags)))
        if bucket.items:
            table_kernel[(bucket.items,)](bucket.work, bucket.tensors, plan.exp_avg_table, counter, values, *args,
                                          GROUPS=config.table_groups,
                                          PREFETCH=prefetch_slots(flags, config.table_groups, config), **flags)
        for _, grid, addrs, wide, cell in bucket.large:
            # a capturable launch reads the gradient's address from its device cell (plans.Bucket.cells), so
            # that a captured launch follows Plan.retarget
            tensor_kernel[grid](addrs[0], cell if on_device else addrs[1], *addrs[2:7], plan.exp_avg_table, counter,
                                values, *addrs[7:], *args, GROUPS=config.large_groups,
                                PREFETCH=prefetch_slots(flags, config.large_groups, config),
                                BLOCKS=config.large_blocks, WIDE=wide, GRAD_CELL=on_device, **flags)


def compile_options(exact: bool = True, quantized: bool = True) -> dict:
    """The compiler options of a launch of the ``exact`` (or approximate) variant on 8-bit (or fp32) moments
    under the current configuration (``LaunchConfig.compile_options``)."""
    return current().replace(exact=exact).compile_options(quantized)


def adam_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor] | None,
    exp_avg_sq_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    scalars: AdamScalars,
    companded: bool,
    skipped: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> None:
    """``reference.adam_step_`` on every tensor of the lists, in one launch per bucket (``plans``).

    Lists may mix param dtypes (bf16/fp16/fp32) and grad dtypes; ``rhos``, when given, holds one rho per
    parameter, all of one dtype (int8 or int16). ``skipped`` is a 0-dim int32 tensor on the parameters'
    device, or None. Every tensor must be contiguous (checked when the launch plan is built, and for a
    gradient whenever its address changes). ``config``: the launch configuration (None: ``config.current()``).
    """
    scales = [exp_avg_scales, exp_avg_sq_scales] if exp_avg_scales is not None else None
    _step_multi(ADAM, params, grads, [exp_avgs, exp_avg_sqs], scales, rhos, cols, scalars, companded=companded,
                decoupled=scalars.decoupled, nesterov=False, skipped=skipped, config=config)


def sgd_step_multi(params, grads, momentum_buffers, momentum_scales, rhos, *, cols, scalars: SGDScalars,
                   companded: bool, skipped: torch.Tensor | None, config: LaunchConfig | None = None) -> None:
    """``reference.sgd_step_`` on every tensor of the lists (``momentum_buffers`` None: no momentum), in one
    launch per bucket; arguments as ``adam_step_multi``."""
    moments = [momentum_buffers] if momentum_buffers is not None else []
    scales = [momentum_scales] if momentum_scales is not None else None
    _step_multi(SGD, params, grads, moments, scales, rhos, cols, scalars, companded=companded,
                decoupled=scalars.decoupled, nesterov=scalars.nesterov, skipped=skipped, config=config)


def lion_step_multi(params, grads, exp_avgs, exp_avg_scales, rhos, *, cols, scalars: LionScalars,
                    companded: bool, skipped: torch.Tensor | None, config: LaunchConfig | None = None) -> None:
    """``reference.lion_step_`` on every tensor of the lists, in one launch per bucket; arguments as
    ``adam_step_multi``."""
    scales = [exp_avg_scales] if exp_avg_scales is not None else None
    _step_multi(LION, params, grads, [exp_avgs], scales, rhos, cols, scalars, companded=companded,
                decoupled=True, nesterov=False, skipped=skipped, config=config)


# The module settings of earlier versions, now fields of LaunchConfig: reading one gives the current
# configuration's value; setting one is refused, since it would change nothing.
_CONFIG_FIELDS = {"EXACT": "exact", "LARGE_NUMEL": "large_numel", "TABLE_GROUPS": "table_groups",
                  "TABLE_BLOCKS": "table_blocks", "LARGE_GROUPS": "large_groups", "LARGE_BLOCKS": "large_blocks",
                  "NUM_WARPS": "num_warps", "PREFETCH": "prefetch", "PREFETCH_AHEAD": "prefetch_ahead",
                  "PREFETCH_LEVEL": "prefetch_level", "MAX_REGISTERS": "max_registers",
                  "APPROX_MAX_REGISTERS": "approx_max_registers", "PLAN_CACHE_SIZE": "plan_cache_size"}


def __getattr__(name: str):
    field = _CONFIG_FIELDS.get(name)
    if field is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(current(), field)


class _Module(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in _CONFIG_FIELDS:
            raise AttributeError(f"flashdist: {__name__}.{name} cannot be set; pass "
                                 f"config=LaunchConfig({_CONFIG_FIELDS[name]}=...) to the launch, or step inside "
                                 f"flashdist.kernels.triton.using(config)")
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Module
