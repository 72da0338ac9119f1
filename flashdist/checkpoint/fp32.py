"""fp32 master weights in and out: export for inference, import to start training from fp32 weights."""

from __future__ import annotations

import torch

from .. import distributed as D
from ..quant import rho as R


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _optimizer_params(optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every name of every parameter: a tied parameter (embedding = LM head) is listed under each of its
    names, as ``model.state_dict()`` lists it, so each alias gets the master weight."""
    return dict(model.named_parameters(remove_duplicate=False))


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = _parameters(model)
    return {k: v for k, v in model.state_dict().items() if k not in params}


@torch.no_grad()
def export_fp32_state_dict(model: torch.nn.Module, optimizer, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights as fp32 master weights (bf16/fp16 parameter + rho), full tensors on the CPU,
    keyed by the model's FQNs (``model.state_dict()`` names, which FSDP2 keeps; a tied parameter under each
    of its names, every one the master weight), ready for
    ``safetensors.torch.save_file`` and Hugging Face loading. Parameters the optimizer does not hold, and
    floating-point buffers, are exported as fp32; other buffers as they are.

    Under FSDP2 every rank must call this (it gathers one parameter at a time); with ``rank0_only`` only
    rank 0 gets the tensors and the other ranks an empty dict, so peak memory is one full parameter."""
    mine = _optimizer_params(optimizer)
    keep = not rank0_only or _rank() == 0
    out: dict[str, torch.Tensor] = {}
    entries = list(_parameters(model).items()) + list(_buffers(model).items())
    for name, t in entries:
        if id(t) in mine:
            t = optimizer.master_weight(t)
        t = D.full_tensor(t.detach())
        if keep:
            out[name] = (t.float() if t.is_floating_point() else t).cpu().contiguous()
    return out


@torch.no_grad()
def load_fp32_state_dict(model: torch.nn.Module, optimizer, state_dict: dict[str, torch.Tensor], *,
                         strict: bool = True) -> None:
    """Set the model's parameters from fp32 (or any float) full weights: each bf16/fp16 parameter gets the
    nearest value and its rho the rest, so training continues from the 24-bit (or 32-bit) master weight.
    Buffers in ``state_dict`` are copied. Every rank passes the same full tensors (e.g. read from one
    safetensors file). Checked first: with ``strict``, missing or unexpected keys raise; shapes must match
    the global shapes. Nothing changes when a check fails."""
    params = _parameters(model)
    buffers = _buffers(model)
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params) - set(buffers))
    if strict and (missing or unexpected):
        raise ValueError(f"flashdist: fp32 state dict does not match the model: missing {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
    targets = {**params, **buffers}
    for name, value in state_dict.items():
        if name not in targets:
            continue
        want = tuple(targets[name].shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            raise ValueError(f"flashdist: fp32 weight '{name}' has shape {tuple(getattr(value, 'shape', ()))}, "
                             f"the model has {want}")
        if targets[name].is_floating_point() and not value.is_floating_point():
            raise ValueError(f"flashdist: fp32 weight '{name}' is {value.dtype}, expected a floating-point tensor")
    mine = _optimizer_params(optimizer)
    for name, value in state_dict.items():
        target = targets.get(name)
        if target is None:
            continue
        local_target = D.local(target)
        rows = D.local_rows(value, target).to(local_target.device)
        if id(target) in mine:
            optimizer.ensure_state(target)  # (state is made at the first step: this may be before it)
        rho = optimizer.state[target].get("rho") if id(target) in mine else None
        if rho is not None:
            low, new_rho = R.split(rows.float(), local_target.dtype, rho.dtype)
            local_target.copy_(low)
            D.local(rho).copy_(new_rho)
        else:
            local_target.copy_(rows.to(local_target.dtype))
