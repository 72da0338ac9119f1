"""Gradient release: step each parameter as soon as its reduced gradient exists, then free the gradient.

Usage::

    optimizer = flashdist.FlashAdamW(model.parameters(), lr=3e-4)
    release = flashdist.enable_gradient_release(model, optimizer)
    for batch in loader:
        loss = model(batch).mean()
        loss.backward()      # each parameter is stepped, and its gradient freed, during backward
        optimizer.step()     # applies nothing new: it marks the end of the iteration (see below)
        scheduler.step()     # learning-rate schedulers keep working: the next backward reads group["lr"]
    release.remove()         # back to ordinary steps

Byte budget: no gradient outlives the backward pass, so FlashAdamW holds 5.125 bytes per parameter
instead of 7.125 (bf16 parameter 2, int8 rho 1, two 8-bit moments with their scales 2 x 1.0625). Under
FSDP2 the unsharded gradients of one FSDP group still exist until their reduce-scatter, as without release.

How it works. A ``register_post_accumulate_grad_hook`` on every trainable parameter of ``model`` that the
optimizer holds. In one process the hook runs when autograd has finished accumulating that parameter's
gradient; under FSDP2 (``fully_shard``) it runs on the sharded DTensor parameter right after the
reduce-scatter (and, for HSDP, the all-reduce) wrote its gradient shard. The hook steps that one
parameter with the same arithmetic as ``optimizer.step()`` and sets ``param.grad = None``. The result is
the ordinary step's (bit for bit with the eager reference backend: every parameter is stepped on its own
either way).

What ``optimizer.step()`` does while release is active: what it always does, step the parameters that
hold a gradient. After a backward under release none does (parameters that are not in ``model`` or were
added to the optimizer later are stepped there as usual). It also ends the iteration: a parameter may be
stepped by release once per ``optimizer.step()`` call, which is how accumulation is detected.

Incompatible, and refused where flashdist can see it:

- Gradient accumulation (several backward passes per optimizer step): each backward would already be a
  step. A parameter that receives a second gradient before ``optimizer.step()`` raises a RuntimeError in
  that backward. So does enabling release while a parameter still holds a gradient. FSDP2's own
  accumulation, ``model.set_requires_gradient_sync(False)`` on all but the last micro-batch, is the one
  form that works: FSDP2 keeps the unsharded gradients and reduces once, so release steps once per
  parameter with the accumulated gradient (and saves no gradient memory during accumulation).
- Global gradient clipping: the norm over all gradients is unknown until the last one exists, and by
  then the others were applied. While release is active, ``torch.nn.utils.clip_grad_norm_`` and
  ``clip_grad_value_`` called on any released parameter raise a RuntimeError (flashdist wraps the two
  functions in ``torch.nn.utils`` while a release handle is active, and restores them on ``remove()``).
  A reference bound before release was enabled (``from torch.nn.utils import clip_grad_norm_``) escapes
  the check: it finds no gradient and does nothing.
- DistributedDataParallel and FSDP1 (``FullyShardedDataParallel``) reduce gradients after the hooks
  have fired: ``enable_gradient_release`` refuses a model that contains either. Use FSDP2.
- ``torch.amp.GradScaler``: the hooks would step with scaled gradients before the scaler unscales them.
  ``scaler.step(optimizer)`` raises a RuntimeError; by then the first backward has already updated the
  parameters with scaled gradients, so restart from a checkpoint after removing the scaler. (bf16
  training, the case flashdist is built for, needs no scaler.)
"""

from __future__ import annotations

import torch

from . import distributed as D
from .optim.base import FlashOptimizer

__all__ = ["GradientRelease", "enable_gradient_release"]

_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_")
_active: list["GradientRelease"] = []
_originals: dict[str, object] = {}


def _refusing(name: str, original):
    def clip(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for handle in _active:
            for p in params:
                if id(p) in handle._params:
                    raise RuntimeError(
                        f"flashdist: torch.nn.utils.{name} on parameter '{handle._params[id(p)][2]}', whose "
                        "gradient release is active: each gradient was applied and freed during backward, "
                        "before a global norm could exist. Remove clipping, or remove() the release handle.")
        return original(params, *args, **kwargs)

    clip.__wrapped__ = original
    clip.__doc__ = original.__doc__
    return clip


def _install_clip_guards(handle: "GradientRelease") -> None:
    if not _active:
        utils = torch.nn.utils
        for name in _CLIP_FUNCTIONS:
            _originals[name] = getattr(utils, name)
            setattr(utils, name, _refusing(name, _originals[name]))
    _active.append(handle)


def _remove_clip_guards(handle: "GradientRelease") -> None:
    if handle in _active:
        _active.remove(handle)
    if not _active and _originals:
        for name, original in _originals.items():
            setattr(torch.nn.utils, name, original)
        _originals.clear()


# Attributes torch.amp.GradScaler sets on an optimizer with ``_step_supports_amp_scaling`` before calling
# its step(); their presence in step() means a scaler is driving the optimizer.
_SCALER_ATTRS = ("grad_scale", "found_inf")


class GradientRelease:
    """Handle returned by :func:`enable_gradient_release`. ``remove()`` (or leaving a ``with`` block)
    unregisters every hook and restores ordinary steps; ``active`` says whether release is on."""

    def __init__(self, model: torch.nn.Module, optimizer: FlashOptimizer):
        if not isinstance(optimizer, FlashOptimizer):
            raise TypeError(f"flashdist: enable_gradient_release needs a flashdist optimizer (FlashAdamW, "
                            f"FlashAdam, ...), got {type(optimizer).__name__}")
        if getattr(optimizer, "_gradient_release", None) is not None:
            raise RuntimeError("flashdist: gradient release is already enabled for this optimizer; call "
                               "remove() on its handle before enabling it again")
        _refuse_late_reducing_wrappers(model)
        owner: dict[int, dict] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                owner[id(p)] = group
        self._optimizer = optimizer
        self._params: dict[int, tuple[torch.Tensor, dict, str]] = {}
        for name, p in model.named_parameters():
            group = owner.get(id(p))
            if group is None or not p.requires_grad:
                continue  # not this optimizer's, or frozen: nothing for a hook to do
            if p.grad is not None:
                raise RuntimeError(f"flashdist: parameter '{name}' holds a gradient; release steps each "
                                   "gradient as it arrives, so call optimizer.zero_grad() before enabling it")
            self._params[id(p)] = (p, group, name)
        if not self._params:
            raise ValueError("flashdist: enable_gradient_release found no trainable parameter of the model "
                             "in the optimizer; build the optimizer from model.parameters()")
        self._stepped: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient)
                         for p, _, _ in self._params.values()]
        self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        # GradScaler.step() then hands its scale to our step() (as grad_scale / found_inf attributes)
        # instead of unscaling the gradients that release has already consumed; _on_optimizer_step refuses.
        optimizer._step_supports_amp_scaling = True
        optimizer._gradient_release = self
        _install_clip_guards(self)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Unregister the hooks; later backward passes leave gradients for ``optimizer.step()`` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stepped.clear()
        _remove_clip_guards(self)
        opt = self._optimizer
        if getattr(opt, "_gradient_release", None) is self:
            opt._gradient_release = None
            vars(opt).pop("_step_supports_amp_scaling", None)

    def __enter__(self) -> GradientRelease:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ----- hooks ---------------------------------------------------------------------------------------

    def _on_gradient(self, p: torch.Tensor) -> None:
        entry = self._params.get(id(p))
        if entry is None or p.grad is None:
            return
        _, group, name = entry
        if id(p) in self._stepped:
            raise RuntimeError(
                f"flashdist: parameter '{name}' received a second gradient before optimizer.step(). Gradient "
                "accumulation cannot be combined with gradient release: each backward pass already stepped "
                "the parameters. Call optimizer.step() once after every backward (under release it only "
                "ends the iteration), or remove() the release handle to accumulate.")
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(f"flashdist: parameter '{name}' has a sparse gradient; flashdist optimizers need "
                               "dense gradients (e.g. nn.Embedding(sparse=False))")
        if grad.shape != p.shape:
            raise RuntimeError(f"flashdist: parameter '{name}' of shape {tuple(p.shape)} has a gradient of "
                               f"shape {tuple(grad.shape)}")
        problem = D.grad_layout_problem(p, grad)
        if problem:
            raise RuntimeError(f"flashdist: parameter '{name}' {problem}")
        with torch.no_grad():
            self._optimizer._check_hyperparameters(group)
            self._optimizer._step_params(group, [p])
        p.grad = None
        self._stepped.add(id(p))

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        scaler_attrs = [a for a in _SCALER_ATTRS if a in vars(optimizer)]
        if scaler_attrs or "grad_scaler" in kwargs:
            for attr in scaler_attrs:  # left behind by the scaler, which deletes them only after a step
                delattr(optimizer, attr)
            raise RuntimeError(
                "flashdist: a GradScaler is stepping an optimizer with gradient release. Release steps during "
                "backward, before the scaler can unscale or check the gradients, so the parameters were "
                "updated with scaled gradients. Train in bf16 without a GradScaler, or remove() the release "
                "handle and restart from a checkpoint.")
        self._stepped.clear()


def _refuse_late_reducing_wrappers(model: torch.nn.Module) -> None:
    """DDP and FSDP1 reduce gradients after the post-accumulate-grad hooks of the original parameters have
    fired: release would step each rank with its own unreduced gradient."""
    wrappers = [torch.nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        wrappers.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    for name, module in model.named_modules():
        if isinstance(module, tuple(wrappers)):
            where = f"'{name}'" if name else "the model"
            raise TypeError(f"flashdist: {where} is wrapped in {type(module).__name__}, which reduces gradients "
                            "after release would have stepped them; shard with FSDP2 (fully_shard) instead")


def enable_gradient_release(model: torch.nn.Module, optimizer: FlashOptimizer) -> GradientRelease:
    """Step every trainable parameter of ``model`` held by ``optimizer`` as soon as its (reduced) gradient
    exists, and free that gradient: single process, or with ``model`` sharded by FSDP2's ``fully_shard``.

    Returns a :class:`GradientRelease` handle; ``handle.remove()`` restores ordinary steps. Keep calling
    ``optimizer.step()`` once per iteration: it ends the iteration (a second backward before it raises,
    since accumulation cannot work under release). Gradient accumulation, global gradient clipping and
    ``torch.amp.GradScaler`` are incompatible and refused with a clear error; see
    :mod:`flashdist.gradient_release`.
    """
    return GradientRelease(model, optimizer)
