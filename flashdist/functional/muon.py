"""Functional FlashMuon step on lists of plain local tensors: the layer under the optimizer class."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..kernels import reference
from ..kernels.scalars import MuonScalars, muon_lr_ratio
from .backend import BACKENDS, cpu_fallback, host_number, on_device, resolve_backend

Orthogonalize = Callable[[Sequence[int], Sequence[torch.Tensor], Callable[[int, torch.Tensor], torch.Tensor]], list]


def matrix_shape(shape, flatten: bool | None = True) -> tuple[int, int]:
    """The shape of each matrix Muon orthogonalizes for a parameter of GLOBAL ``shape`` (two or more dims).
    2-D: the parameter itself. More dims with ``flatten=True``: one matrix ``(shape[0], prod(shape[1:]))``, rows
    as flashdist's quantization layout takes them (a conv weight ``(out, in, kh, kw)`` is ``(out, in * kh *
    kw)``, as Keller Jordan's Muon reshapes it); with ``flatten=False``: ``prod(shape[:-2])`` matrices of
    ``(shape[-2], shape[-1])``, each orthogonalized on its own (stacked weights such as MoE experts ``(experts,
    out, in)``). ``flatten=None`` (not chosen) refuses more than 2 dims: neither view is right for every
    weight, and a wrong one trains without a word."""
    if len(shape) < 2:
        raise ValueError(f"flashdist: Muon orthogonalizes matrices; a parameter of shape {tuple(shape)} has fewer "
                         "than 2 dims (give it use_muon=False: flashdist.muon_param_groups does)")
    if len(shape) == 2 or flatten:
        return shape[0], math.prod(shape[1:])
    if flatten is None:
        raise ValueError(unchosen_view(f"a parameter of shape {tuple(shape)}"))
    return shape[-2], shape[-1]


def unchosen_view(what: str) -> str:
    """The one-line refusal of a parameter of more than 2 dims in a Muon group that has not chosen its view."""
    return (f"flashdist: FlashMuon got {what}, which has more than 2 dims: set flatten in its param group, True for "
            "a conv-like weight (one matrix (shape[0], rest), Keller Jordan's reshape) or False for stacked "
            "matrices such as MoE experts (each [i, ...] of the last two dims orthogonalized on its own); "
            "flashdist.muon_param_groups(model) sets it from the module")


def local_orthogonalize(indices: Sequence[int], updates: Sequence[torch.Tensor],
                        whole: Callable[[int, torch.Tensor], torch.Tensor]) -> list:
    """Orthogonalize unsharded updates where they are: ``whole(i, update)`` of each (one process, DDP)."""
    return [whole(i, u) for i, u in zip(indices, updates)]


def flash_muon(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    momentum_scales: Sequence[torch.Tensor] | None,
    rhos: Sequence[torch.Tensor] | None,
    *,
    cols: Sequence[int] | None,
    shapes: Sequence[tuple[int, ...]],
    lr: float | torch.Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    flatten: bool | None = None,
    transposed: bool = False,
    companded: bool = True,
    skipped: torch.Tensor | None = None,
    backend: str = "auto",
    orthogonalize: Orthogonalize | None = None,
    grad_cells: torch.Tensor | None = None,
) -> None:
    """One Muon step (torch.optim.Muon's update, decoupled weight decay), in place, on local tensors.

    Three phases. 1: on each local tensor, ``buf = lerp(buf, g, 1 - momentum)``, re-quantized (int8 codes
    with bf16 ``momentum_scales`` of shape (rows, ceil(cols/32)), or fp32 ``momentum_buffers`` when
    ``momentum_scales`` is None), and the update ``U = lerp(g, buf, momentum)`` (Nesterov) or ``buf``.
    2: Newton-Schulz on each WHOLE matrix (``shapes[i]``, the parameter's global shape, viewed as
    ``matrix_shape(shapes[i], flatten)``: a parameter of more than 2 dims is one matrix with ``flatten=True``,
    a stack of matrices orthogonalized one by one with ``flatten=False``, refused with None; ``transposed``:
    each matrix is stored as ``(in, out)``, so ``adjust_lr_fn`` reads its rows and columns swapped):
    ``orthogonalize(indices, local updates, whole)`` returns each tensor's local part of ``whole(i, full
    update i)``; the default takes the local tensors to be whole (one process), and
    ``flashdist.distributed.gather.OwnerOrthogonalize`` gathers each to one owner rank and sends the result
    back. Newton-Schulz starts by rounding the update to bf16, so that is what travels. The three phases run
    on ``orthogonalize.chunk`` matrices at a time (its attribute; 1 by default): the owners of a chunk's
    matrices compute at the same time, and only a chunk's updates are held (bf16) beside the state. 3: on
    each local tensor, ``theta = theta * (1 - lr * weight_decay) - adjusted_lr * O`` on the master weight
    ``param + rho`` (``rhos`` None: the parameter itself), ``adjusted_lr`` from ``adjust_lr_fn`` and the
    shape of each matrix.

    ``lr``: a float, or a one-element tensor; with the Triton kernels, one on the parameters' device is read
    there when the weight update runs (no host synchronisation: a CUDA graph can capture the step), with the
    bits of the same float. ``backend``: "auto" (the Triton kernels of phases 1 and 3 on CUDA,
    ``kernels/triton/muon.py``; the fused CPU phases on the CPU, ``kernels/cpu``, where they are built, else
    the eager reference), "triton", "cpu" or "reference", the same bits. ``skipped`` counts the values of
    matrices left unchanged because their update was not finite (``reference.muon_apply_``).
    ``grad_cells`` (Triton kernels only): an int64 tensor on the parameters' device whose row ``i`` starts with
    the address the momentum kernel reads gradient ``i`` from (``grads[i]`` then gives its dtype and shape), so
    that a CUDA graph capturing the step reads each replay's gradients where the cells say (``GraphedStep``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"flashdist: backend must be one of {BACKENDS}, got {backend!r}")
    if not params:
        return
    chosen = resolve_backend(backend, params[0].device)
    if chosen == "triton":  # the kernels read flat storage: checked before anything changes
        for what, tensors in (("gradient", grads), ("parameter", params)):
            bad = next((i for i, t in enumerate(tensors) if not t.is_contiguous()), None)
            if bad is not None:
                raise ValueError(f"flashdist: FlashMuon's Triton kernels read flat storage, but the {what} of matrix "
                                 f"{bad} (shape {tuple(tensors[bad].shape)}) has strides {tensors[bad].stride()}: "
                                 "make it contiguous (.contiguous()), or use backend='reference'")
    if grad_cells is not None and chosen != "triton":
        raise ValueError("flashdist: flash_muon's grad_cells are read by the Triton kernels: use CUDA tensors")
    # capturable: a learning rate held on the parameters' device is read there by the weight update's kernel
    device_lr = lr if chosen == "triton" and on_device(lr, params[0].device) else None
    views = [matrix_shape(shape, flatten) for shape in shapes]  # (refuses an unchosen view before any change)
    stacked = [len(shape) > 2 and flatten is False for shape in shapes]  # stacks of matrices, one by one
    # (transposed: matrices stored as (in, out), Hugging Face's is_transposed experts: the ratio an nn.Linear's
    # (out, in) would get; the orthogonalization of a transpose is the transpose of its, bit for bit)
    ratios = [muon_lr_ratio(adjust_lr_fn, *(view[::-1] if transposed else view)) for view in views]
    scalars = [MuonScalars.make(lr=0.0 if device_lr is not None else host_number(lr), weight_decay=weight_decay,
                                momentum=momentum, nesterov=nesterov, lr_ratio=ratio) for ratio in ratios]
    if chosen == "triton":
        from ..kernels.triton.muon import muon_apply, muon_momentum as momentum_

        def apply_(i, param, rho, ortho):
            muon_apply(param, rho, ortho, scalars=scalars[i], skipped=skipped, lr=device_lr,
                       weight_decay=weight_decay, lr_ratio=ratios[i])
    elif chosen == "cpu":  # the fused CPU phases, the reference where they cannot run (auto) or an error (cpu)
        from ..kernels import cpu

        def apply_(i, param, rho, ortho):
            if cpu_fallback(backend, cpu.muon_apply(param, rho, ortho.contiguous(), scalars=scalars[i],
                                                    skipped=skipped)):
                reference.muon_apply_(param, rho, ortho, scalars=scalars[i], skipped=skipped)

        def momentum_(*args, **kwargs):
            update = cpu.muon_momentum(*args, **kwargs)
            return reference.muon_momentum_(*args, **kwargs).bfloat16() if cpu_fallback(backend, update is not None) \
                else update
    else:
        def apply_(i, param, rho, ortho):
            reference.muon_apply_(param, rho, ortho, scalars=scalars[i], skipped=skipped)

        def momentum_(*args, **kwargs):
            return reference.muon_momentum_(*args, **kwargs).bfloat16()

    def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
        return reference.newton_schulz(matrix, coefficients=ns_coefficients, steps=ns_steps, eps=eps)

    def whole(i: int, update: torch.Tensor) -> torch.Tensor:
        # one matrix, or a stack orthogonalized one by one (whole, or the whole matrices of a rank's shard of it)
        matrices = update.reshape(math.prod(update.shape[:-2]) if stacked[i] else 1, *views[i])
        if matrices.shape[0] == 1:  # (Tensor.__len__ is a Python call)
            return newton_schulz(matrices[0]).reshape(update.shape)
        out = torch.empty(matrices.shape, dtype=torch.bfloat16, device=update.device)
        for k, matrix in enumerate(matrices):
            out[k] = newton_schulz(matrix)
        return out.reshape(update.shape)

    if orthogonalize is None:
        for p, shape in zip(params, shapes):
            if tuple(p.shape) != tuple(shape):
                raise ValueError(f"flashdist: flash_muon got a local tensor of shape {tuple(p.shape)} for a matrix "
                                 f"of shape {tuple(shape)}; a sharded matrix needs an orthogonalize= that gathers "
                                 "it (flashdist.distributed.gather.OwnerOrthogonalize)")
        orthogonalize = local_orthogonalize
    chunk = max(1, getattr(orthogonalize, "chunk", 1))
    for start in range(0, len(params), chunk):
        indices = range(start, min(start + chunk, len(params)))
        # an empty local tensor (an empty shard, or a matrix with a zero dim) has no momentum to update and no
        # weight to change; its empty update still takes part in the exchange, which every rank makes alike
        updates = [
            momentum_(grads[i], momentum_buffers[i], momentum_scales[i] if momentum_scales is not None else None,
                      cols=cols[i] if cols is not None else None, scalars=scalars[i], companded=companded,
                      **({"grad_cell": grad_cells[i]} if grad_cells is not None else {}))
            if params[i].numel() else grads[i].bfloat16()
            for i in indices
        ]
        orthos = orthogonalize(indices, updates, whole)
        del updates
        for i, ortho in zip(indices, orthos):
            if params[i].numel():
                apply_(i, params[i], rhos[i] if rhos is not None else None, ortho)
