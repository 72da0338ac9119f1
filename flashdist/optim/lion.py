"""FlashLion."""

from __future__ import annotations

from ..functional.lion import flash_lion
from .base import FlashOptimizer
from .params import check_betas, check_number, check_step_scalars


class FlashLion(FlashOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") with 24-bit master weights
    and an 8-bit companded momentum (FlashOptim, arXiv:2602.23349).

    The update: ``theta = theta * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m = beta2 * m + (1 - beta2) * g``; the state is the momentum ``exp_avg`` (and ``step``, counted but
    unused by the update).

    Bytes per parameter held (bf16 parameters): the parameter (2) + rho (1, int8) + the bf16 gradient (2)
    + the momentum (int8 code 1 + a bf16 scale per 32 values 1/16) = 6.0625; 4.0625 with gradient
    release. With fp32 master weights and momentum Lion holds 12.

    Args:
        params: parameters or param groups, as for any torch optimizer; ``named_parameters()`` gives error
            messages with parameter names. bf16/fp16/fp32, plain tensors or FSDP2 DTensors.
        lr: learning rate (default 1e-4: Lion's steps have magnitude lr in every coordinate, so it wants an
            lr 3-10x smaller than AdamW's, and a weight decay 3-10x larger).
        betas: (beta1, beta2), the interpolation of the update direction and of the momentum (0.9, 0.99).
        weight_decay: decoupled weight decay (default 0).
        master_weight_bits, quantize_states, companded, backend, state_dict_format, flat_layout, capturable,
        graphed: as :class:`flashdist.FlashAdamW`.

    Caveats: those of :class:`flashdist.FlashAdamW`. ``sign(0)`` is 0: a coordinate whose interpolation is
    exactly zero does not move (apart from weight decay).
    """

    _moments = ("exp_avg",)

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, master_weight_bits: int | None = 24, quantize_states: bool = True,
                 companded: bool = True, backend: str = "auto", state_dict_format: str = "portable",
                 flat_layout: bool = False, capturable: bool = False, graphed: bool = False):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, master_weight_bits=master_weight_bits,
                        quantize_states=quantize_states, companded=companded, flat_layout=flat_layout)
        super().__init__(params, defaults, backend=backend, state_dict_format=state_dict_format,
                         capturable=capturable, graphed=graphed)

    def _check_hyperparameters(self, group: dict) -> None:
        check_number("lr", group["lr"], low=0.0)
        check_betas(group["betas"], high_open=False)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        check_step_scalars(group, step_size_of_beta1=False)

    def _step_bucket(self, group, bucket, grads, step, skipped):
        beta1, beta2 = group["betas"]
        flash_lion(bucket.params, bucket.local_grads(grads), bucket.moments[0], bucket.scales[0], bucket.rhos,
                   cols=bucket.cols, lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
                   weight_decay=float(group["weight_decay"]), companded=group["companded"], skipped=skipped,
                   backend=self.backend)
