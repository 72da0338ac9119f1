"""Gradient release: step parameters as soon as their reduced gradients exist, then free the gradients.

Usage::

    optimizer = flashdist.FlashAdamW(model.parameters(), lr=3e-4)
    release = flashdist.enable_gradient_release(model, optimizer)
    for batch in loader:
        loss = model(batch).mean()
        loss.backward()      # the parameters are stepped, and their gradients freed, during backward
        optimizer.step()     # applies nothing new: it marks the end of the iteration (see below)
        scheduler.step()     # learning-rate schedulers keep working: the next backward reads group["lr"]
    release.remove()         # back to ordinary steps

Byte budget: no gradient outlives the backward pass, so FlashAdamW holds 5.125 bytes per parameter
instead of 7.125 (bf16 parameter 2, int8 rho 1, two 8-bit moments with their scales 2 x 1.0625). Under
FSDP2 the unsharded gradients of one FSDP group still exist until their reduce-scatter, as without release.
FlashMuon's matrices hold 4.0625 instead of 6.0625 (parameter 2, rho 1, the 8-bit momentum 1.0625): release
saves the gradient's 2 bytes and nothing of Muon's whole-matrix update, whose bf16 copy (a rank's part of
the matrices being orthogonalized, the whole matrix on its owner, plus Newton-Schulz's work space) exists
during that group's step with or without release; under FSDP2 each group's matrices are gathered to their
owners inside backward (every rank makes the same calls in the same order).

How it works. A ``register_post_accumulate_grad_hook`` on every trainable parameter of ``model`` that the
optimizer holds records the parameter as pending once its gradient is final; pending parameters are
stepped in batches, each batch with one call of the optimizer's multi-tensor step per param group (one
fused launch plan, cached for that fixed list of parameters), after which their gradients are freed:

- Under FSDP2 (``fully_shard``) the hooks run on the sharded DTensor parameters right after the
  reduce-scatter (and, for HSDP, the all-reduce) of their FSDP parameter group wrote the gradient shards,
  all of one group in one go. A group is complete in the hook of its last parameter; complete groups are
  stepped together as soon as their gradient shards add up to ``bucket_mb`` MiB (default 64; 0 steps each
  group as soon as it is complete), a shard counted as its parameter's bytes over the ranks that split it,
  so that every rank steps the same groups together even where shards are uneven (FlashMuon's step
  exchanges updates between the ranks, which must take part in the same order). Each call costs host time on
  the thread that runs the backward pass, which FSDP2 often keeps busy issuing kernels: fewer, larger calls
  leave the GPU waiting less, for at most ``bucket_mb`` of gradient shards held a little longer. On CUDA the
  step is queued on a side stream of flashdist's (one per device) that waits for the stream FSDP2 runs the
  hooks on (the reduce-scatter stream: a step queued there would hold back the following reduce-scatters and
  the all-gathers NCCL orders behind them); the caller's stream waits for
  the side stream at the end of backward, so the next forward, ``optimizer.step()`` or a checkpoint sees
  the stepped parameters. A group in which some parameter got no gradient is complete when the next group's
  gradients arrive, or at the end of backward. The gradient shards of one group are views of one
  reduce-scatter buffer, which lives until the last of them is dropped: stepping a group in one call holds
  no byte longer than stepping its parameters one by one did.
- Parameters outside FSDP2 (one process) are stepped in arrival order in batches of about ``bucket_mb``
  MiB of gradients (default 64; 0 steps each parameter on its own): at most one batch of gradients is
  held beyond what stepping each parameter at once would hold.
- At the end of every backward pass (a callback queued on autograd's engine by the first hook of that
  pass, which runs after FSDP2's own end-of-backward work) whatever is still pending is stepped. So no
  gradient outlives ``backward()``. A hook that fires outside autograd's backward, where no such callback
  can be queued, steps what is pending at once and makes the caller's stream wait for that step.

The result is the ordinary step's: the same arithmetic on the same gradients, bit for bit with the eager
reference backend (which steps tensor by tensor either way) and with the fused kernel (whose arithmetic
is per element). ``handle.optimizer_calls`` counts the batches stepped.

What ``optimizer.step()`` does while release is active: what it always does, step the parameters that
hold a gradient. After a backward under release none does (parameters that are not in ``model`` or were
added to the optimizer later are stepped there as usual). It also ends the iteration: a parameter may
receive one gradient per ``optimizer.step()`` call, which is how accumulation is detected.

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

import contextlib
import functools
import weakref

import torch

from . import distributed as D
from .distributed.fsdp import fsdp_units
from .optim.base import FlashOptimizer

__all__ = ["GradientRelease", "enable_gradient_release"]

_CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grad_value_")
_active: list["GradientRelease"] = []
_handle_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its active handle
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


_SINGLE = -1  # the batch of parameters outside any FSDP2 group


class _Batch:
    """Parameters whose final gradients arrived and that are not stepped yet: one FSDP2 group's, or a
    bucket of parameters outside FSDP2."""

    __slots__ = ("params", "count", "nbytes", "streams")

    def __init__(self):
        self.params: dict[int, list[torch.Tensor]] = {}  # index of the param group -> params, arrival order
        self.count = 0
        self.nbytes = 0
        self.streams: list = []  # CUDA streams the hooks ran on (where the gradients were written)


class GradientRelease:
    """Handle returned by :func:`enable_gradient_release`. ``remove()`` (or leaving a ``with`` block)
    unregisters every hook and restores ordinary steps; ``active`` says whether release is on;
    ``optimizer_calls`` counts the batched optimizer calls issued so far (one per batch and param group)."""

    def __init__(self, model: torch.nn.Module, optimizer: FlashOptimizer, bucket_mb: float = 64.0):
        if not isinstance(optimizer, FlashOptimizer):
            raise TypeError(f"flashdist: enable_gradient_release needs a flashdist optimizer (FlashAdamW, "
                            f"FlashAdam, ...), got {type(optimizer).__name__}")
        if _handle_of.get(optimizer) is not None:
            raise RuntimeError("flashdist: gradient release is already enabled for this optimizer; call "
                               "remove() on its handle before enabling it again")
        if (not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or not bucket_mb >= 0
                or bucket_mb == float("inf")):
            raise ValueError(f"flashdist: bucket_mb must be a finite number >= 0, got {bucket_mb!r}")
        _refuse_late_reducing_wrappers(model)
        owner: dict[int, tuple[dict, int]] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                owner[id(p)] = (group, index)
        self._optimizer = optimizer
        self._params: dict[int, tuple[torch.Tensor, dict, str]] = {}
        self._group_index: dict[int, int] = {}
        for name, p in model.named_parameters():
            found = owner.get(id(p))
            if found is None or not p.requires_grad:
                continue  # not this optimizer's, or frozen: nothing for a hook to do
            if p.grad is not None:
                raise RuntimeError(f"flashdist: parameter '{name}' holds a gradient; release steps each "
                                   "gradient as it arrives, so call optimizer.zero_grad() before enabling it")
            self._params[id(p)] = (p, found[0], name)
            self._group_index[id(p)] = found[1]
        if not self._params:
            raise ValueError("flashdist: enable_gradient_release found no trainable parameter of the model "
                             "in the optimizer; build the optimizer from model.parameters()")
        units = fsdp_units(model)
        self._unit_of = {pid: units.get(pid, _SINGLE) for pid in self._params}
        self._expected: dict[int, int] = {}  # FSDP2 group -> released parameters it reduces
        for unit in self._unit_of.values():
            self._expected[unit] = self._expected.get(unit, 0) + 1
        self._bucket_bytes = int(bucket_mb * 2**20)
        self._pending: dict[int, _Batch] = {}
        self._open: int | None = None  # the FSDP2 group whose gradients arrived last and are pending
        # complete batches (all the gradients they will get this pass) waiting to be stepped together
        self._ready: list[_Batch] = []
        self._ready_bytes = 0
        self._seen: set[int] = set()  # parameters that received their gradient since optimizer.step()
        self._queued: set[int] = set()  # autograd graph tasks whose end-of-backward callback is queued
        # CUDA: the steps run on a stream of their own per device (see _flush); the streams that have
        # steps the caller's stream has not waited for yet
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._unjoined: set[torch.device] = set()
        self.optimizer_calls = 0
        # Plans cached by earlier ordinary steps bind the parameters' step counters to their own lists;
        # release steps other lists, so start (and end, in remove()) from fresh plans.
        optimizer.clear_plans()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient)
                         for p, _, _ in self._params.values()]
        self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        # GradScaler.step() then hands its scale to our step() (as grad_scale / found_inf attributes)
        # instead of unscaling the gradients that release has already consumed; _on_optimizer_step refuses.
        optimizer._step_supports_amp_scaling = True
        _handle_of[optimizer] = self
        _install_clip_guards(self)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        """Unregister the hooks; later backward passes leave gradients for ``optimizer.step()`` again."""
        for handle in self._handles:
            handle.remove()
        was_active = bool(self._handles)
        self._handles = []
        self._seen.clear()
        self._pending.clear()  # only after a failed backward: those parameters keep their gradients
        self._ready.clear()
        self._ready_bytes = 0
        self._open = None
        self._join_side_streams()
        _remove_clip_guards(self)
        opt = self._optimizer
        if was_active:
            opt.clear_plans()
        if _handle_of.get(opt) is self:
            del _handle_of[opt]
            vars(opt).pop("_step_supports_amp_scaling", None)

    def __enter__(self) -> GradientRelease:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ----- hooks ---------------------------------------------------------------------------------------

    def _on_gradient(self, p: torch.Tensor) -> None:
        pid = id(p)
        entry = self._params.get(pid)
        if entry is None or p.grad is None:
            return
        name = entry[2]
        task = torch._C._current_graph_task_id()
        if task >= 0 and task not in self._queued and self._queued:
            # A new backward pass while the end-of-backward callback of an earlier one never ran: that pass
            # raised. What it left pending is not stepped (its parameters keep their gradients, which
            # optimizer.zero_grad() clears), and its parameters may receive a gradient again.
            self._queued.clear()
            self._seen.clear()
            self._pending.clear()
            self._ready.clear()
            self._ready_bytes = 0
            self._open = None
            self._join_side_streams()
        if pid in self._seen:
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
        self._seen.add(pid)

        if task >= 0 and task not in self._queued:
            # Step whatever is still pending at the end of this backward pass. FSDP2 queues its own
            # end-of-backward callback (which reduces the groups whose reduce-scatter had not run, e.g. the
            # root's) before any gradient exists, and callbacks run in order, so this one runs after it.
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._end_of_backward, task))
            self._queued.add(task)

        unit = self._unit_of[pid]
        if unit != _SINGLE and self._open is not None and self._open != unit:
            # FSDP2 runs the hooks of one group together: another group's gradients mean that the previous
            # group's reduce is over, whatever it still lacks will not come in this pass.
            self._complete(self._open)
        batch = self._pending.get(unit)
        if batch is None:
            batch = self._pending[unit] = _Batch()
        batch.params.setdefault(self._group_index[pid], []).append(p)
        batch.count += 1
        local = D.local(grad)
        # (the average shard's bytes: ranks with uneven shards reach bucket_mb at the same group, so that a
        # step that exchanges data between the ranks, FlashMuon's, runs at the same point on every rank)
        batch.nbytes += D.share_bytes(grad)
        if local.is_cuda:
            stream = torch.cuda.current_stream(local.device)
            if stream not in batch.streams:
                batch.streams.append(stream)
        if unit != _SINGLE:
            if batch.count == self._expected[unit]:
                self._complete(unit)
            else:
                self._open = unit
        elif batch.nbytes >= self._bucket_bytes:
            self._complete(unit)
        if task < 0:  # a hook outside autograd's backward (no end-of-backward callback): step now
            self._flush_all()
            self._join_side_streams()

    def _end_of_backward(self, task: int) -> None:
        self._queued.discard(task)
        if self._handles:
            self._flush_all()
        self._join_side_streams()

    def _complete(self, unit: int) -> None:
        """``unit``'s pending batch has every gradient it gets in this pass: queue it, and step the queued
        batches together once their gradients reach ``bucket_mb``."""
        if self._open == unit:
            self._open = None
        batch = self._pending.pop(unit, None)
        if batch is None:
            return
        self._ready.append(batch)
        self._ready_bytes += batch.nbytes
        if self._ready_bytes >= self._bucket_bytes:
            self._flush()

    def _flush_all(self) -> None:
        for unit in list(self._pending):
            self._complete(unit)
        self._flush()

    def _flush(self) -> None:
        """Step the queued batches: one optimizer call per param group; free their gradients."""
        batches, self._ready, self._ready_bytes = self._ready, [], 0
        if not batches:
            return
        opt = self._optimizer
        # parameters by param group, in arrival order (a parameter whose gradient was cleared meanwhile, e.g.
        # by zero_grad() after a failed backward, is left out)
        merged: dict[int, list[torch.Tensor]] = {}
        streams: list = []
        host_grads = False
        for batch in batches:
            for index, params in batch.params.items():
                kept = [p for p in params if p.grad is not None]
                merged.setdefault(index, []).extend(kept)
                # one look per batch: FSDP2 offloads a whole unit or none of it
                host_grads = host_grads or (bool(kept) and not D.local(kept[0].grad).is_cuda)
            streams.extend(stream for stream in batch.streams if stream not in streams)
        params_by_group = [(index, merged[index]) for index in sorted(merged) if merged[index]]
        if host_grads and torch.cuda.is_initialized():
            # Host gradients on a CUDA machine: FSDP2's CPUOffloadPolicy copies each gradient shard to pinned
            # host memory; earlier torch releases copy asynchronously even when a hook reads the gradient
            # (waiting only at the end of backward; torch 2.13 copies synchronously then): wait for the copies
            # before the CPU step reads them.
            torch.cuda.synchronize()
        context = contextlib.nullcontext()
        if len({stream.device for stream in streams}) > 1:
            # one process, parameters on several GPUs: step each on its device's current stream, after the
            # streams that wrote its gradients
            for stream in streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            for _, params in params_by_group:
                for p in params:
                    grad = D.local(p.grad)
                    if grad.is_cuda:
                        grad.record_stream(torch.cuda.current_stream(grad.device))
        elif streams:
            # Under FSDP2 the hooks run on the reduce-scatter stream: a step queued there would hold back
            # the following reduce-scatters (and the all-gathers NCCL orders behind them). So the steps run
            # on a side stream of their own that waits for the streams that wrote the gradients; the
            # gradients are marked as read there (the caching allocator then keeps their memory until the
            # step ran), and the caller's stream waits for the side stream at the end of backward.
            device = streams[0].device
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device=device)
            for stream in streams:
                side.wait_stream(stream)
            for _, params in params_by_group:
                for p in params:
                    grad = D.local(p.grad)
                    if grad.is_cuda:  # (a CPU-offloaded FSDP2 group may share the batch)
                        grad.record_stream(side)
            self._unjoined.add(device)
            context = torch.cuda.stream(side)
        try:
            with torch.no_grad(), context:
                for index, params in params_by_group:
                    group = opt.param_groups[index]
                    opt.check_group(group)
                    opt.step_parameters(group, params)
                    self.optimizer_calls += 1
                    for p in params:
                        p.grad = None
        except BaseException:
            # what was not stepped stays queued (stepped parameters no longer hold a gradient and are left
            # out when the batches are stepped again): optimizer.step() steps the rest, zero_grad() drops it
            self._ready = batches + self._ready
            self._ready_bytes += sum(batch.nbytes for batch in batches)
            raise

    def _join_side_streams(self) -> None:
        """Make the current stream of each device wait for the steps queued on its side stream: whatever
        runs next (the next forward's all-gathers, a checkpoint, an evaluation) sees the stepped parameters."""
        for device in self._unjoined:
            torch.cuda.current_stream(device).wait_stream(self._side_streams[device])
        self._unjoined.clear()

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
        self._flush_all()  # nothing is pending after a completed backward; after a failed one, step them
        self._join_side_streams()
        self._seen.clear()


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


def enable_gradient_release(model: torch.nn.Module, optimizer: FlashOptimizer, *,
                            bucket_mb: float = 64.0) -> GradientRelease:
    """Step every trainable parameter of ``model`` held by ``optimizer`` as soon as its (reduced) gradient
    exists, and free that gradient: single process, or with ``model`` sharded by FSDP2's ``fully_shard``.
    Parameters are stepped in batches of about ``bucket_mb`` MiB of gradients: under FSDP2 whole FSDP groups,
    each complete after its reduce-scatter (0: each group on its own, right after its reduce-scatter);
    outside FSDP2 parameters in arrival order (0: one parameter per batch); whatever is pending at the end
    of backward is stepped then.

    Returns a :class:`GradientRelease` handle; ``handle.remove()`` restores ordinary steps. Keep calling
    ``optimizer.step()`` once per iteration: it ends the iteration (a second backward before it raises,
    since accumulation cannot work under release). Gradient accumulation, global gradient clipping and
    ``torch.amp.GradScaler`` are incompatible and refused with a clear error; see
    :mod:`flashdist.gradient_release`.
    """
    return GradientRelease(model, optimizer, bucket_mb)
