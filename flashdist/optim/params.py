"""What the optimizers accept as parameters and hyper-parameters, and how a parameter is named in messages."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .. import distributed as D
from .._compat import HAS_TRITON
from ..quant import codes as Q

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def param_name(group: dict, index: int, p: torch.Tensor, groups: list[dict] | None = None) -> str:
    """The parameter's name when the optimizer was given ``named_parameters()``, else its position, with the
    group's index in ``groups`` (the optimizer's ``param_groups``; ``[...]`` for a group not among them)."""
    names = group.get("param_names")
    named = names and index < len(names)  # (a parameter appended to a named group's list has no name)
    at = _group_index(group, groups)
    where = f"'{names[index]}'" if named else f"param_groups[{at}]['params'][{index}]"
    return f"{where} (shape {tuple(p.shape)}, {p.dtype})"


def _group_index(group: dict, groups: list[dict] | None) -> int | str:
    """``group``'s index in ``groups`` (by identity), or ``...`` where it is not there or there is no list."""
    return "..." if groups is None else next((i for i, g in enumerate(groups) if g is group), "...")


def check_param(group: dict, index: int, p: torch.Tensor, groups: list[dict] | None = None) -> None:
    """Refuse, naming it, a parameter the optimizer cannot step: not a tensor, an unsupported dtype, sparse,
    not contiguous, or a DTensor whose placements would cut quantization groups. ``groups``: as for
    :func:`param_name` (a group being added: the optimizer's groups and it)."""
    if not isinstance(p, torch.Tensor):
        at = _group_index(group, groups)
        raise TypeError(f"flashdist: param_groups[{at}]['params'][{index}] is a {type(p).__name__}, not a tensor")
    name = param_name(group, index, p, groups)
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"flashdist: {name} has dtype {p.dtype}; flashdist optimizers take bfloat16, "
                        "float16 or float32 parameters (cast the model, e.g. model.to(torch.bfloat16))")
    if p.is_sparse:
        raise TypeError(f"flashdist: {name} is sparse; flashdist optimizers need dense parameters")
    if not D.local(p).is_contiguous():
        raise ValueError(f"flashdist: {name} is not contiguous (strides {D.local(p).stride()}); the fused "
                         "step works on contiguous storage: make it contiguous before building the optimizer")
    D.check_placements(p, name, Q.GROUP if group["quantize_states"] else None)
    if group.get("flat_layout", False) and D.is_dtensor(p):
        raise ValueError(f"flashdist: {name} is a DTensor in a flat_layout group; flat_layout is for DeepSpeed's "
                         "flat 1-D partitions (plain tensors). FSDP2 parameters use the row-aligned layout: "
                         "leave flat_layout=False")


def check_overlaps(params: list[tuple[dict, int, torch.Tensor]], groups: list[dict] | None = None) -> None:
    """Refuse a tensor given twice (in one group or in two) and two parameters whose memory overlaps (views
    of one storage): each would be stepped, so the shared values would be updated twice per step. torch.optim
    refuses the same tensor in two groups and only warns about it twice in one group (a future error there);
    flashdist refuses both, since a second update would run with the first one's bias correction."""
    first: dict[int, tuple[dict, int]] = {}
    for group, index, p in params:
        seen = first.setdefault(id(p), (group, index))
        if seen[0] is not group or seen[1] != index:
            where = "twice in one param group" if seen[0] is group else "in two param groups"
            also = param_name(seen[0], seen[1], p, groups).split(" (")[0]
            raise ValueError(f"flashdist: {param_name(group, index, p, groups)} is given {where} (also as {also}); it "
                             "would be stepped twice per step: pass each parameter once")
    spans = []
    for group, index, p in params:
        lp = D.local(p)
        if lp.numel() == 0 or lp.device.type == "meta":
            continue
        start = lp.data_ptr()
        spans.append((lp.untyped_storage().data_ptr(), start, start + lp.numel() * lp.element_size(), p,
                      group, index))
    spans.sort(key=lambda s: (s[0], s[1]))  # an overlap, if any, shows between neighbours in this order
    for (sa, _, end_a, pa, ga, ia), (sb, start_b, _, pb, gb, ib) in zip(spans, spans[1:]):
        if sa == sb and start_b < end_a and pa is not pb:
            name_a, name_b = param_name(ga, ia, pa, groups), param_name(gb, ib, pb, groups)
            raise ValueError(f"flashdist: parameters {name_a} and {name_b} overlap in memory (views of one "
                             "storage), so the shared values would be stepped twice; pass each tensor once")


FP32_MAX = float(torch.finfo(torch.float32).max)


def check_number(name: str, value: Any, *, low: float, high: float | None = None, high_open: bool = False):
    """A finite real number in the range given, that fits fp32 (the kernels take every hyper-parameter and
    the scalars made from it as fp32); else a ValueError naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"flashdist: {name} must be a number, got a tensor of shape {tuple(value.shape)}")
        if value.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # a step being captured cannot read it (it was checked at the warm-up step)
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"flashdist: {name} must be a finite real number, got {value!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"in [{low}, {high})" if high_open else (f"in [{low}, {high}]" if high is not None else f">= {low}")
        raise ValueError(f"flashdist: {name} must be {bound}, got {value!r}")
    if abs(value) > FP32_MAX:
        raise ValueError(f"flashdist: {name}={value!r} overflows fp32 (largest {FP32_MAX:.4g}), the precision the "
                         "step computes in")


def check_fp32_product(name: str, value: float, why: str) -> None:
    """Refuse a hyper-parameter whose derived per-step scalar ``value`` (e.g. the first Adam step's
    ``lr / (1 - beta1)``) overflows fp32, as torch.optim refuses it ("cannot be converted to type float
    without overflow"), naming ``name`` and the scalar ``why``."""
    if isinstance(value, numbers.Real) and abs(value) > FP32_MAX:
        raise ValueError(f"flashdist: {name} is too large: {why} = {value:.4g} overflows fp32 (largest "
                         f"{FP32_MAX:.4g}): lower it")


def check_step_scalars(group: dict, *, step_size_of_beta1: bool) -> None:
    """Refuse ``lr`` (or ``weight_decay``) whose per-step scalars overflow fp32: ``lr * weight_decay`` and, for
    Adam (``step_size_of_beta1``), the first step's ``lr / (1 - betas[0])``. Tensor hyper-parameters are
    checked where they are read (a step being captured cannot read them)."""
    lr, wd = group["lr"], group.get("weight_decay", 0.0)
    if isinstance(lr, torch.Tensor) or isinstance(wd, torch.Tensor):
        return
    check_fp32_product("lr", lr * wd, "lr * weight_decay")
    if step_size_of_beta1:
        beta1 = group["betas"][0]
        if not isinstance(beta1, torch.Tensor) and beta1 < 1:
            check_fp32_product("lr", lr / (1.0 - beta1), "the first step's step size lr / (1 - betas[0])")


def check_betas(betas: Any, *, high_open: bool, name: str = "betas") -> None:
    """A pair of numbers in [0, 1) (``high_open``: Adam) or [0, 1] (Lion); errors name ``name``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"flashdist: {name} must be a pair of numbers, got {betas!r}")
    check_number(f"{name}[0]", betas[0], low=0.0, high=1.0, high_open=high_open)
    check_number(f"{name}[1]", betas[1], low=0.0, high=1.0, high_open=high_open)


UNIMPLEMENTED_OPTIONS = ("maximize", "amsgrad", "differentiable")
"""torch.optim param-group options that change the update and no flashdist optimizer implements."""


def check_unimplemented(group: dict, optimizer: str) -> None:
    """Refuse a torch.optim option that changes the update, set true (as torch's optimizers take it in a param
    group, e.g. a group copied from an AdamW config), which no flashdist update implements: it would be kept in
    the group and never read."""
    for key in UNIMPLEMENTED_OPTIONS:
        if group.get(key):
            raise ValueError(f"flashdist: a param group sets {key}={group[key]!r}, which {optimizer} does not "
                             "implement (its update would ignore it): remove it from the group")


def check_names(params: list, index: int) -> bool:
    """Whether the entries of ``param_groups[index]['params']`` are ``(name, parameter)`` pairs (True) or
    tensors (False); a mix, or a tuple that is no such pair, is refused in one line."""
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        other = named.index(not named[0])
        raise ValueError(f"flashdist: param_groups[{index}]'s params mix (name, parameter) pairs and bare tensors "
                         f"(entry {other} is {'a bare ' + type(params[other]).__name__ if named[0] else 'a pair'}): "
                         "give all with names (model.named_parameters()) or none")
    bad = next((i for i, p in enumerate(params) if named[i] and not (len(p) == 2 and isinstance(p[0], str))), None)
    if bad is not None:
        raise ValueError(f"flashdist: param_groups[{index}]['params'][{bad}] is a tuple that is not a (name, "
                         "parameter) pair: give model.named_parameters() or tensors")
    return bool(params) and named[0]


def check_flat_storage(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], backend: str,
                       dtensors: bool, name) -> None:
    """Where the step reads flat storage (the Triton kernels; the fused CPU step where ``backend="cpu"`` allows
    no fallback to the reference), refuse in one line the first parameter (``p.data`` replaced after
    construction, as ``model.to(memory_format=...)`` does) or gradient that is not contiguous, before anything
    changes; ``name(group, p)`` names it. C-level maps, per-tensor Python only where one is off."""
    if not params or not (backend in ("cpu", "triton") or (
            backend == "auto" and D.local(params[0]).device.type == "cuda" and HAS_TRITON)):
        return
    local = (lambda ts: map(D.local, ts)) if dtensors else iter
    if all(map(_CONTIGUOUS, local(params))) and all(map(_CONTIGUOUS, local(grads))):
        return
    for p in params:
        for what, t, fix in (("storage", p, "make the parameter contiguous (the model's default memory format)"),
                             ("a gradient", p.grad, "make it contiguous (p.grad = p.grad.contiguous())")):
            if not D.local(t).is_contiguous():
                raise ValueError(f"flashdist: {name(group, p)} has {what} that is not contiguous (strides "
                                 f"{D.local(t).stride()}) and backend {backend!r} reads flat storage: {fix}, or "
                                 "use backend='reference'")


_CONTIGUOUS = torch.Tensor.is_contiguous
