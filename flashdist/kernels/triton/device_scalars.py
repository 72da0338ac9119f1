"""The per-step scalars of a capturable step, computed on the device: no host value changes between steps, so
the step can be captured in a CUDA graph and replayed.

``scalars_kernel`` reads the step count (the fp32 count of the step being taken, as the optimizers keep it on
the device) and, optionally, the learning rate from device memory, and writes the ``KERNEL_SLOTS`` fp32
scalars that ``AdamScalars``, ``SGDScalars`` or ``LionScalars`` (flashdist/kernels/scalars.py) compute on the
host, in the same slots: the fused step reads them from there (``SCALARS``). Every value is the host's
float64 arithmetic, operation by operation (one IEEE operation each, FMA contraction off, ``scalars.power``'s
repeated squaring for the betas' powers), rounded once to fp32: the same bits. The hyper-parameters fixed
between steps travel as the bits of their float64 values (a float argument would be fp32).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ..scalars import KERNEL_SLOTS, AdamScalars, DeviceScalars
from .bits import ADAM, ADAM_ALGO, LION, LION_ALGO, SGD, SGD_ALGO

_POWER_BITS = 32  # bits of the step count walked by the repeated squaring (fp32 counts stop at 2^24)


@triton.jit
def f64(bits):
    """float64 from its bits, an integer kernel argument."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit(do_not_specialize=["lr_bits", "h0", "h1", "h2", "h3"])
def scalars_kernel(
    count_ptr,  # fp32 step count of the step being taken (1-based)
    lr_ptr,  # the learning rate (any float dtype) when LR_PTR, else unused
    out_ptr,  # fp32 (KERNEL_SLOTS,): the kernel's scalar slots
    lr_bits,  # float64 bits of the learning rate when not LR_PTR
    # float64 bits of Adam's beta1, beta2, eps, weight_decay; SGD's momentum, dampening, weight_decay; or
    # Lion's beta1, beta2, weight_decay
    h0, h1, h2, h3,
    ALGO: tl.constexpr, DECOUPLED: tl.constexpr, LR_PTR: tl.constexpr, POWER_BITS: tl.constexpr,
):
    if ALGO != LION_ALGO:
        n = tl.load(count_ptr).to(tl.int64)
    if LR_PTR:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = f64(lr_bits)
    one = tl.full([], 1.0, tl.float64)
    if ALGO == SGD_ALGO:
        momentum, dampening, weight_decay = f64(h0), f64(h1), f64(h2)
        first = n == 1
        tl.store(out_ptr + 0, tl.where(first, 0.0, momentum.to(tl.float32)))  # momentum_decay
        tl.store(out_ptr + 1, momentum.to(tl.float32))
        tl.store(out_ptr + 2, tl.where(first, 1.0, (one - dampening).to(tl.float32)))  # momentum_gain
        tl.store(out_ptr + 3, 0.0)
        tl.store(out_ptr + 4, 0.0)
        tl.store(out_ptr + 5, weight_decay.to(tl.float32))
    else:  # Adam and Lion
        beta1, beta2 = f64(h0), f64(h1)
        tl.store(out_ptr + 0, beta1.to(tl.float32))
        tl.store(out_ptr + 1, beta2.to(tl.float32))
        tl.store(out_ptr + 2, (one - beta1).to(tl.float32))
        tl.store(out_ptr + 3, (one - beta2).to(tl.float32))
        if ALGO == ADAM_ALGO:
            eps, weight_decay = f64(h2), f64(h3)
            tl.store(out_ptr + 4, eps.to(tl.float32))
            tl.store(out_ptr + 5, weight_decay.to(tl.float32))
        else:
            weight_decay = f64(h2)
            tl.store(out_ptr + 4, 0.0)
            tl.store(out_ptr + 5, 0.0)
    if DECOUPLED:
        tl.store(out_ptr + 6, (one - lr * weight_decay).to(tl.float32))
    else:
        tl.store(out_ptr + 6, 1.0)
    if ALGO == ADAM_ALGO:
        # scalars.power: the product of beta^(2^k) over the set bits k of n, lowest first
        pow1, pow2 = one, one
        square1, square2 = beta1, beta2
        for k in tl.static_range(POWER_BITS):
            bit = ((n >> k) & 1) != 0
            pow1 = tl.where(bit, pow1 * square1, pow1)
            pow2 = tl.where(bit, pow2 * square2, pow2)
            square1 = square1 * square1
            square2 = square2 * square2
        # float64 division and square root are IEEE's (div.rn.f64, sqrt.rn.f64): only fp32 has fast variants
        tl.store(out_ptr + 7, (lr / (one - pow1)).to(tl.float32))  # step_size
        tl.store(out_ptr + 8, (one / tl.sqrt(one - pow2)).to(tl.float32))  # inv_bias_correction2_sqrt
    else:
        tl.store(out_ptr + 7, lr.to(tl.float32))
        tl.store(out_ptr + 8, 0.0)


def f64_bits(x: float) -> int:
    """The bits of ``x`` as float64, as an int: a float kernel argument would travel as fp32."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def device_scalars(algo: int, count: torch.Tensor | None, lr: float | torch.Tensor, hyper: tuple[float, ...], *,
                   decoupled: bool, device: torch.device) -> torch.Tensor:
    """The fp32 kernel slots of update ``algo`` at the step ``count`` (an fp32 tensor of one element on
    ``device``: the 1-based count of the step being taken; None for Lion, whose scalars do not depend on it)
    with learning rate ``lr`` (a float, or a one-element tensor on ``device``, read when the kernel runs): an
    fp32 ``(KERNEL_SLOTS,)`` tensor on ``device``. ``hyper``: Adam's (beta1, beta2, eps, weight_decay), SGD's
    (momentum, dampening, weight_decay) or Lion's (beta1, beta2, weight_decay). One launch, no host
    synchronisation."""
    from .config import current

    out = torch.empty(KERNEL_SLOTS, dtype=torch.float32, device=device)
    lr_is_tensor = isinstance(lr, torch.Tensor)
    h = [f64_bits(x) for x in hyper] + [0] * (4 - len(hyper))
    scalars_kernel[(1,)](count if count is not None else out, lr if lr_is_tensor else out, out,
                         0 if lr_is_tensor else f64_bits(lr), *h, ALGO=algo, DECOUPLED=decoupled, LR_PTR=lr_is_tensor,
                         POWER_BITS=_POWER_BITS, **current().compile_options(quantized=False))
    return out


def adam(step: torch.Tensor, lr, *, beta1: float, beta2: float, eps: float, weight_decay: float,
         decoupled: bool) -> DeviceScalars:
    """``AdamScalars.make`` of the step count ``step`` and learning rate ``lr`` held on the device."""
    # the launch's FAST_UPDATE is decided from the first step's 1 / sqrt(1 - beta2^t), the largest
    first = AdamScalars.make(lr=0.0, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=1,
                             decoupled=decoupled)
    values = device_scalars(ADAM, step, lr, (beta1, beta2, eps, weight_decay), decoupled=decoupled,
                            device=step.device)
    return DeviceScalars(values, decoupled, eps=first.eps, inv_bias_correction2_sqrt=first.inv_bias_correction2_sqrt)


def sgd(step: torch.Tensor, lr, *, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
        decoupled: bool) -> DeviceScalars:
    """``SGDScalars.make`` of the step count ``step`` and learning rate ``lr`` held on the device."""
    values = device_scalars(SGD, step, lr, (momentum, dampening, weight_decay), decoupled=decoupled,
                            device=step.device)
    return DeviceScalars(values, decoupled, nesterov=nesterov)


def lion(lr: torch.Tensor, *, beta1: float, beta2: float, weight_decay: float) -> DeviceScalars:
    """``LionScalars.make`` of the learning rate ``lr`` held on the device."""
    values = device_scalars(LION, None, lr, (beta1, beta2, weight_decay), decoupled=True, device=lr.device)
    return DeviceScalars(values, True)
