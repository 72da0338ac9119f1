"""FlashSGD and FlashSGDW."""

from __future__ import annotations

from ..functional.sgd import flash_sgd
from .base import FlashOptimizer
from .params import check_number, check_step_scalars


class FlashSGD(FlashOptimizer):
    """SGD with momentum, 24-bit master weights and an 8-bit companded momentum buffer (FlashOptim,
    arXiv:2602.23349).

    A drop-in ``torch.optim.SGD``: weight decay added to the gradient (L2), ``momentum``, ``dampening`` and
    ``nesterov`` with torch's conventions (the buffer starts as the first gradient itself, undamped).

    Bytes per parameter held (bf16 parameters): the parameter (2) + rho (1, int8) + the bf16 gradient (2)
    + the momentum buffer (int8 code 1 + a bf16 scale per 32 values 1/16) = 6.0625; 4.0625 with gradient
    release; without momentum (``momentum=0``, torch's default) no buffer exists: 5, or 3 with release.
    torch.optim.SGD with fp32 master weights holds 12 (4 + 4 + 4).

    Args:
        params: parameters or param groups, as for any torch optimizer; ``named_parameters()`` gives error
            messages with parameter names. bf16/fp16/fp32, plain tensors or FSDP2 DTensors.
        lr, momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``. A group's
            momentum buffer is made when momentum is first non-zero (at construction, or later by a momentum
            schedule such as CyclicLR's ``cycle_momentum``, as torch makes it at first use); once made, the
            value may change but not return to 0.
        master_weight_bits, quantize_states, companded, backend, state_dict_format, flat_layout, capturable,
        graphed: as :class:`flashdist.FlashAdamW`; the portable state dict holds fp32 ``momentum_buffer``
            (torch.optim.SGD's name, so it loads into torch.optim.SGD and back) plus ``rho`` and ``step``.

    Caveats: those of :class:`flashdist.FlashAdamW` (fp32 buffers for 0-d and 1-d parameters outside
    flat_layout groups; a group of 32 values whose gradient holds a NaN or an Inf, or whose momentum or new
    weight would overflow, is skipped and counted in ``optimizer.skipped``). The 8-bit buffer quantizes ``momentum * buf + (1 - dampening) * g`` after every
    step, like FlashAdamW's first moment.
    """

    _moments = ("momentum_buffer",)
    keeps_step_count = False
    _decoupled = False

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, master_weight_bits: int | None = 24,
                 quantize_states: bool = True, companded: bool = True, backend: str = "auto",
                 state_dict_format: str = "portable", flat_layout: bool = False, capturable: bool = False,
                 graphed: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        master_weight_bits=master_weight_bits, quantize_states=quantize_states,
                        companded=companded, flat_layout=flat_layout)
        super().__init__(params, defaults, backend=backend, state_dict_format=state_dict_format,
                         capturable=capturable, graphed=graphed)

    def moments_of(self, group: dict) -> tuple[str, ...]:
        return self._moments if group["momentum"] != 0 else ()

    def _check_hyperparameters(self, group: dict) -> None:
        check_number("lr", group["lr"], low=0.0)
        check_number("momentum", group["momentum"], low=0.0)
        check_number("dampening", group["dampening"], low=0.0, high=1.0)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        check_step_scalars(group, step_size_of_beta1=False)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"flashdist: nesterov must be True or False, got {group['nesterov']!r}")
        if group["nesterov"] and (group["momentum"] == 0 or group["dampening"] != 0):
            raise ValueError("flashdist: nesterov=True needs a non-zero momentum and zero dampening (as "
                             f"torch.optim.SGD), got momentum={group['momentum']!r}, "
                             f"dampening={group['dampening']!r}")
        # A buffer is made when momentum turns non-zero (torch.optim.SGD makes it at first use, and CyclicLR /
        # OneCycleLR's default cycle_momentum turns it on): a zero buffer gives torch's first-use buffer (the
        # gradient itself) only without dampening. Turning momentum off again would drop a live buffer.
        state = next((self.state[p] for p in group["params"] if p in self.state), None)  # frozen ones hold none
        if state:
            has_buffer = any(key.startswith("momentum_buffer") for key in state)
            if has_buffer and group["momentum"] == 0:
                raise ValueError(f"flashdist: momentum of a param group is now {group['momentum']!r} while its "
                                 "momentum buffer holds state; a schedule may vary it but not set it to 0: keep a "
                                 "tiny non-zero momentum, or build a new optimizer")
            if not has_buffer and group["momentum"] != 0 and group["dampening"] != 0:
                raise ValueError(f"flashdist: momentum of a param group was 0 when the optimizer was built and is "
                                 f"now {group['momentum']!r} with dampening={group['dampening']!r}; a buffer made now "
                                 "would not start as torch.optim.SGD's (the gradient): build the optimizer with "
                                 "the momentum on, or use dampening=0")

    def _plan(self, group, params):
        # momentum turned on since the plan was made (a momentum schedule): the plan has no buffers to step
        if group["momentum"] != 0 and params[0] in self.state \
                and not any(key.startswith("momentum_buffer") for key in self.state[params[0]]):
            self._invalidate_plans()
        return super()._plan(group, params)

    def _step_bucket(self, group, bucket, grads, step, skipped):
        momentum = bool(bucket.moments)
        flash_sgd(bucket.params, bucket.local_grads(grads), bucket.moments[0] if momentum else None,
                  bucket.scales[0] if momentum else None, bucket.rhos, cols=bucket.cols, lr=group["lr"],
                  momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                  weight_decay=float(group["weight_decay"]), nesterov=group["nesterov"], step=step,
                  decoupled=self._decoupled, companded=group["companded"], skipped=skipped, backend=self.backend)


class FlashSGDW(FlashSGD):
    """SGD with decoupled weight decay (the master weight is multiplied by ``1 - lr * weight_decay`` before
    the gradient step, as AdamW does for Adam) and FlashSGD's memory layout: see :class:`FlashSGD` for the
    byte budget, arguments and caveats."""

    _decoupled = True
