"""The fp32-parameter precision warning: fp32 parameters in a setting where the model likely computes in bf16
get fp32 gradients and no 24-bit rho split, which is rarely what the user meant."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from .. import distributed as D
from .params import param_name

class PrecisionWarning(UserWarning):
    """fp32 parameters handed to a flashdist optimizer in a setting where the model likely computes in bf16."""


_INTERNAL_FILES = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside flashdist and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_FILES):
        frame, level = frame.f_back, level + 1
    return level


def warn_precision(message: str | None) -> bool:
    """Warn ``message`` as a PrecisionWarning pointed at the user's code; whether it warned."""
    if message is None:
        return False
    warnings.warn(message, PrecisionWarning, stacklevel=caller_stacklevel())
    return True


def fp32_group_warning(optimizer: str, params, group: dict) -> str | None:
    """The warning for a group whose trainable parameters are all fp32 while it asks for 24-bit masters (the
    default), or None: the sign of an fp32 model that computes in bf16 (HF ``bf16=True`` autocast,
    Accelerate's FSDP2 mixed precision, which upcasts the parameters)."""
    if group["master_weight_bits"] != 24 or group.get("flat_layout", False):
        return None
    params = [p for p in params if p.requires_grad]
    if not params or any(p.dtype != torch.float32 for p in params):
        return None
    cast = ("If the model computes in bf16 (autocast, Trainer bf16=True, FSDP2/Accelerate mixed precision), cast "
            "it to bf16 before building the optimizer (model.to(torch.bfloat16)) to keep bf16 weights with 24-bit "
            "masters: see docs/integrations.md.")
    if "peft" in sys.modules:  # (imported by the user, or by a library such as the Trainer: never imported here)
        cast = peft_fp32_advice() + " Otherwise: " + cast[0].lower() + cast[1:]
    return (f"flashdist: {optimizer} got fp32 parameters ({len(params)} in a group); they are their own master "
            f"weights: fp32 gradients, no 8-bit rho split. {cast} For deliberate fp32 training pass "
            "master_weight_bits=None (it only affects bf16/fp16 parameters; Trainer: "
            "optim_args='master_weight_bits=none') to silence this.")


def peft_fp32_advice() -> str:
    """The advice for PEFT adapters, given where PEFT is loaded (the optimizer cannot tell adapters from a model
    trained in full, and the Trainer imports PEFT whenever it is installed): its adapters are fp32 by design
    (``autocast_adapter_dtype``) and PEFT upcasts them again whenever it loads them (``load_adapter``, which a
    Trainer resume calls), so a bf16 cast would not survive a resume. Keeping them fp32 costs little:
    adapters are a small part of the model, and an fp32 adapter is its own exact master."""
    return ("If they are PEFT adapters (PEFT is loaded), keep them fp32: PEFT upcasts adapters again whenever it "
            "loads them (a Trainer resume calls load_adapter), so a bf16 cast does not survive a resume, and "
            "adapters, a small part of the model, hardly need the rho split (docs/integrations.md#peft-lora-"
            "through-the-trainer).")


def fsdp_low_precision_fp32(param_groups, model: torch.nn.Module) -> list[str]:
    """Names (FQNs in ``model``) of the trainable fp32 parameters of ``param_groups`` that FSDP2 computes in
    bf16 or fp16."""
    names = {id(p): n for n, p in model.named_parameters()}
    compute = D.fsdp_compute_dtypes(model)
    return [names.get(id(p), param_name(g, i, p, param_groups))
            for g in param_groups for i, p in enumerate(g["params"]) if p.requires_grad and p.dtype == torch.float32
            and compute.get(id(p), torch.float32) in (torch.bfloat16, torch.float16)]


def fsdp_warning(optimizer: str, found: list[str]) -> str:
    return (f"flashdist: FSDP2 computes {len(found)} fp32 parameters of {optimizer} in lower precision (e.g. "
            f"{found[0]}): they get fp32 gradients and no 8-bit rho split. Cast the model to bf16 before sharding "
            "and building the optimizer, without FSDP2 mixed precision, to keep bf16 weights with 24-bit masters: "
            "see docs/integrations.md.")
