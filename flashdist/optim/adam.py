"""FlashAdamW and FlashAdam."""

from __future__ import annotations

from ..functional.adam import flash_adam
from .base import FlashOptimizer
from .params import check_betas, check_number, check_step_scalars


class FlashAdamW(FlashOptimizer):
    """AdamW with 24-bit master weights and 8-bit companded moments (FlashOptim, arXiv:2602.23349, Alg. 4).

    A drop-in ``torch.optim.AdamW`` (decoupled weight decay, torch's bias correction and eps convention).

    Bytes per parameter held (bf16 parameters): the parameter (2) + rho (1, int8) + the bf16 gradient (2)
    + the first moment (int8 code 1 + a bf16 scale per 32 values 1/16) + the second moment (uint8 1 + 1/16)
    = 7.125; 5.125 with gradient release. ``master_weight_bits=32`` makes rho int16 (+1 byte); ``None``
    drops rho (pure bf16 training: updates smaller than half a bf16 spacing are lost).

    Args:
        params: parameters or param groups, as for any torch optimizer (lists, tuples, generators,
            ``named_parameters()``, a single tensor, in each group too); ``named_parameters()`` gives error
            messages with parameter names. bf16/fp16/fp32, plain tensors or FSDP2 DTensors. Two parameters
            whose memory overlaps (views of one storage) are refused, naming both: each would be stepped.
            Frozen parameters (``requires_grad=False``) hold no state until a step finds a gradient on them
            (a ``state_dict()`` taken once they are trainable holds theirs, so every rank saves the same keys).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``, but finite (inf and NaN are refused, here and
            when set on a live group before a step), and ``eps > 0``: torch accepts ``eps=0`` and returns NaN
            where a gradient was always 0; with 8-bit moments a second-moment code of 0 under a non-zero first
            moment would give inf.
        master_weight_bits: 24 (int8 rho, default), 32 (int16 rho) or None. Only bf16/fp16 parameters
            are split; fp32 parameters are their own master weight. A group of only fp32 parameters with the
            default 24 draws one ``flashdist.PrecisionWarning``: it is the sign of an fp32 model
            that computes in bf16 (autocast, the Trainer's ``bf16=True``, Accelerate's FSDP2 mixed precision,
            which upcasts the parameters), which gets fp32 gradients and no 24-bit split; cast the model to
            bf16 before building the optimizer (docs/integrations.md). ``master_weight_bits=None`` says the
            fp32 parameters are meant and silences it. After FSDP2 sharding,
            ``optimizer.check_precision(model)`` reads the model's ``MixedPrecisionPolicy`` and names the
            fp32 parameters it computes in bf16/fp16 (no guess, no false alarm).
        quantize_states: keep the moments as 8-bit codes (default) or as fp32.
        companded: softsign (first moment) and sqrt (second moment) companding before 8-bit group
            quantization (default); False is linear group absmax for both, the paper's ablation.
        backend: "auto" (the Triton kernel for CUDA tensors; for CPU tensors the fused C++ step, built at its
            first use, or the eager reference where no compiler is present), "triton", "cpu" or "reference".
        state_dict_format: "portable" (default: fp32 ``exp_avg``/``exp_avg_sq`` as torch.optim.AdamW, plus
            ``rho``; loads at any world size and into AdamW) or "compressed" (codes, scales and rho: 2.125
            bytes + rho per parameter, resharded exactly by torch.distributed.checkpoint).
        flat_layout: quantize each tensor of the group as ONE row of ``numel`` values (groups of 32
            consecutive values in storage order) instead of row-aligned groups, so 1-d tensors get 8-bit
            moments too (scales of shape ``(1, ceil(numel / 32))``). Meant for DeepSpeed ZeRO, whose flat
            1-d partitions concatenate many parameters (flashdist.integrations.deepspeed sets it); the state
            of such a group is created at its first step, because ZeRO swaps the group's tensors for its
            partitions after construction. Plain tensors only (not FSDP2 DTensors). Default False.
        capturable: keep the step counts on the parameters' GPU and compute the update's scalars there, so
            that a CUDA graph can capture the step (as torch.optim's ``capturable``); the same bits as without.
            ``flashdist.GraphedStep(optimizer)`` captures and replays it while the tensors it reads stay where
            they were (docs/integrations.md). In a graph the caller captures, a float ``lr`` is fixed at
            capture: give a tensor on the GPU to change it between replays. Nothing changes on the CPU. Like
            ``backend``, a setting of the optimizer (``optimizer.capturable``), not of its param groups: it is
            not in the state dict, and loading one leaves it as it is. Default False.
        graphed: ``step()`` itself captures the step in a CUDA graph and replays it while the tensors it reads
            stay where they were, stepping eagerly otherwise (a ``flashdist.GraphedStep`` inside ``step()``, so
            that clients that call ``optimizer.step()`` themselves, the Trainer, Lightning, torchtitan, get it
            too); implies ``capturable=True``. Steps with a closure, and steps of parameters that are not on
            one GPU, run eagerly. Default False.

    Caveats. Moments of 0-d and 1-d parameters stay fp32 outside flat_layout groups (they are a tiny
    share of any model; their FSDP2 shards cut anywhere, so no row-aligned group exists). A group of 32
    values of one row whose gradient holds a NaN or an Inf, or whose step would overflow (a finite gradient
    above about 1.8e19: docs/method.md), is skipped: its parameter, rho and moments stay as they were, and ``optimizer.skipped`` (an int32 tensor on the parameters' device, no sync needed to
    keep counting) counts the skipped groups. Layout options (master_weight_bits, quantize_states,
    companded, flat_layout) are fixed once the optimizer is built: changed on a live param group, the next
    step refuses them, naming the option, and changes nothing.

    Behaves like a torch.optim.Optimizer where clients reach it: ``state_dict``/``load_state_dict`` hooks run
    as in torch (post-hooks see and may replace the returned dict; load pre-hooks may replace the loaded
    one); ``copy.deepcopy`` and pickling give an optimizer that steps its own copies of the parameters;
    state follows the parameters in ``param_groups`` when a framework swaps them (Accelerate's FSDP2
    ``prepare``): new ones get state on first sight, replaced ones lose theirs. ``torch.compile`` does not
    trace the step: ``torch.compile(optimizer.step)`` runs it eagerly (the step keeps Python-side plans
    dynamo cannot trace, and the fused kernel is already one launch per group), a compiled function that
    calls ``optimizer.step()`` breaks its graph there, and ``fullgraph=True`` raises dynamo's error, with
    that reason, before anything changed. Compiling the model is unaffected.
    """

    _moments = ("exp_avg", "exp_avg_sq")
    _decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_weight_bits: int | None = 24, quantize_states: bool = True,
                 companded: bool = True, backend: str = "auto", state_dict_format: str = "portable",
                 flat_layout: bool = False, capturable: bool = False, graphed: bool = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        master_weight_bits=master_weight_bits, quantize_states=quantize_states,
                        companded=companded, flat_layout=flat_layout)
        super().__init__(params, defaults, backend=backend, state_dict_format=state_dict_format,
                         capturable=capturable, graphed=graphed)

    def _check_hyperparameters(self, group: dict) -> None:
        check_number("lr", group["lr"], low=0.0)
        check_betas(group["betas"], high_open=True)
        check_number("eps", group["eps"], low=0.0)
        if group["eps"] == 0:  # 8-bit second moments round small values to 0: m / sqrt(0) would be inf or NaN
            raise ValueError("flashdist: eps must be > 0, got 0; the quantized second moment can be exactly 0 "
                             "where the first is not, so eps=0 turns the update into inf or NaN (use e.g. 1e-8)")
        check_number("weight_decay", group["weight_decay"], low=0.0)
        check_step_scalars(group, step_size_of_beta1=True)

    def _step_bucket(self, group, bucket, grads, step, skipped):
        (m, v), (ms, vs) = bucket.moments, bucket.scales
        beta1, beta2 = group["betas"]
        flash_adam(bucket.params, bucket.local_grads(grads), m, v, ms, vs, bucket.rhos, cols=bucket.cols,
                   lr=group["lr"], beta1=float(beta1),
                   beta2=float(beta2), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                   step=step, decoupled=self._decoupled, companded=group["companded"], skipped=skipped,
                   backend=self.backend)


class FlashAdam(FlashAdamW):
    """Adam with L2 weight decay added to the gradient (``torch.optim.Adam``'s convention), with FlashAdamW's
    memory layout: see :class:`FlashAdamW` for the byte budget, arguments and caveats."""

    _decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
