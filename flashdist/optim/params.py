"""What the optimizers accept as parameters and hyper-parameters, and how a parameter is named in messages."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import distributed as D
from ..quant import codes as Q

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def param_name(group: dict, index: int, p: torch.Tensor) -> str:
    """The parameter's name when the optimizer was given ``named_parameters()``, else its position."""
    names = group.get("param_names")
    where = f"'{names[index]}'" if names else f"param_groups[...]['params'][{index}]"
    return f"{where} (shape {tuple(p.shape)}, {p.dtype})"


def check_param(group: dict, index: int, p: torch.Tensor) -> None:
    """Refuse, naming it, a parameter the optimizer cannot step: not a tensor, an unsupported dtype, sparse,
    not contiguous, or a DTensor whose placements would cut quantization groups."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"flashdist: param_groups[...]['params'][{index}] is a {type(p).__name__}, not a tensor")
    name = param_name(group, index, p)
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


def check_overlaps(params: list[tuple[dict, int, torch.Tensor]]) -> None:
    """Refuse two parameters whose memory overlaps (views of one storage): each would be stepped, so the
    shared values would be updated twice per step. The same tensor twice is torch's business (it refuses
    it across groups and warns within one)."""
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
            name_a, name_b = param_name(ga, ia, pa), param_name(gb, ib, pb)
            raise ValueError(f"flashdist: parameters {name_a} and {name_b} overlap in memory (views of one "
                             "storage), so the shared values would be stepped twice; pass each tensor once")


def check_number(name: str, value: Any, *, low: float, high: float | None = None, high_open: bool = False):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"flashdist: {name} must be a number, got a tensor of shape {tuple(value.shape)}")
        if value.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # a step being captured cannot read it (it was checked at the warm-up step)
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"flashdist: {name} must be a finite real number, got {value!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"[{low}, {high})" if high_open else (f"[{low}, {high}]" if high is not None else f">= {low}")
        raise ValueError(f"flashdist: {name} must be in {bound}, got {value!r}")


def check_betas(betas: Any, *, high_open: bool) -> None:
    """A pair of numbers in [0, 1) (``high_open``: Adam) or [0, 1] (Lion)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"flashdist: betas must be a pair of numbers, got {betas!r}")
    check_number("betas[0]", betas[0], low=0.0, high=1.0, high_open=high_open)
    check_number("betas[1]", betas[1], low=0.0, high=1.0, high_open=high_open)
