"""State that follows ``param_groups``: made at a parameter's first step (or when a state dict, a load or
``ensure_state`` needs it), dropped when the parameter leaves every group, checked when a framework swaps
parameters in after construction. A mixin of FlashOptimizer, which owns the caches it reads."""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict

import torch

from .. import distributed as D
from ..quant import rho as R
from ..quant.moment import MomentLayout, QuantizedMoment
from .layout import LayoutOptions
from .params import check_overlaps, check_param, param_name
from .precision import warn_precision


class _State(defaultdict):
    """``optimizer.state``: torch's ``defaultdict(dict)``, except that it is true while the optimizer has a
    trainable parameter, stepped or not. State is made at the first step, and
    torch.distributed.checkpoint's ``get_optimizer_state_dict`` makes the state of an optimizer whose state
    is false by a zero-gradient step, which would count as step 1; ``state_dict()`` makes the (zero) state
    itself instead. Pickled and copied as a plain ``defaultdict``."""

    def __init__(self, owner=None):
        super().__init__(dict)
        self._owner = weakref.ref(owner) if owner is not None else None

    def __bool__(self) -> bool:
        if len(self):
            return True
        owner = self._owner() if self._owner is not None else None
        return owner is not None and any(p.requires_grad for g in owner.param_groups for p in g["params"])

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter(self.items())


def _fresh(state: dict) -> bool:
    """Is this the state a parameter's first step starts from: step 0, every tensor zero (moments, scales,
    rho)?"""
    step = state.get("step")
    if step is None or float(step) != 0:
        return False
    return all(not bool(D.local(v).any()) for k, v in state.items()
               if k != "step" and isinstance(v, torch.Tensor) and v.numel())


def _synced_entry(group: dict) -> tuple[dict, int, list]:
    return group, id(group["params"]), [weakref.ref(p) for p in group["params"]]


class StateLifecycle:
    """FlashOptimizer's state lifecycle: ``optimizer.state`` kept in line with ``param_groups``."""

    def _wrap_state(self) -> None:
        state = _State(self)
        state.update(self.state)
        self.state = state

    def _groups_changed(self, thorough: bool = True) -> bool:
        """Whether ``param_groups`` holds other parameters than when last synced. ``thorough``: one identity
        comparison per parameter, in C (``map``); otherwise (every step) the same group dicts holding the
        same list objects of the same lengths: a list changed in place is caught when the step's plan no
        longer matches the parameters with gradients (``_step_params``), or by ``state_dict``."""
        synced = self._synced
        if len(synced) != len(self.param_groups):
            return True
        for group, (seen_group, seen_list, seen) in zip(self.param_groups, synced):
            params = group["params"]
            if group is not seen_group or id(params) != seen_list or len(params) != len(seen):
                return True
            # (a list object freed and another made at its address is caught by the identities below, which
            # the step's plan compares too when it is rebuilt)
            if thorough and not all(map(operator.is_, params, [ref() for ref in seen])):
                return True
        return False

    def sync_state(self) -> None:
        """Bring the state in line with the parameters in ``param_groups`` now: check parameters never seen
        before (their state is made at their first step, or by ``state_dict`` / ``load_state_dict``), drop the
        state of parameters no longer in any group (not of tensors once in a ``flat_layout`` group: DeepSpeed
        ZeRO-3 swaps its partitions in and out of the group around each step, and the state is its to keep),
        and forget every cached plan. Called by ``step``, ``state_dict``, ``load_state_dict`` and
        ``flashdist.memory_report`` when the groups changed; cheap to call again."""
        if not self._groups_changed():
            return
        seen = {id(ref()) for _, _, refs in self._synced for ref in refs if ref() is not None}
        new = [(group, i, p) for group in self.param_groups for i, p in enumerate(group["params"])
               if id(p) not in seen]
        for group, i, p in new:
            check_param(group, i, p, self.param_groups)
            self._check_not_flat_partition(group, i, p)
        check_overlaps([(g, i, q) for g in self.param_groups for i, q in enumerate(g["params"])],
                       self.param_groups)  # (twice, too)
        # a group dict put into param_groups directly is validated here, before anything changes
        layouts = {id(g): self._layouts.get(id(g)) or LayoutOptions.from_group(g) for g in self.param_groups}
        live = {id(p) for group in self.param_groups for p in group["params"]}
        self._flat_ids.update(id(p) for group in self.param_groups if group.get("flat_layout", False)
                              for p in group["params"])
        for p in [p for p in self.state if id(p) not in live and id(p) not in self._flat_ids]:
            del self.state[p]
        self._invalidate_plans()
        live_state = set(map(id, self.state))
        self._written = {k: v for k, v in self._written.items() if k in live_state}
        self._rho_dtypes = {p: v for p, v in self._rho_dtypes.items() if id(p) in live_state}
        self._dtensor_groups = {id(g) for g in self.param_groups if any(D.is_dtensor(p) for p in g["params"])}
        self._layouts = layouts
        self._synced = [_synced_entry(group) for group in self.param_groups]
        for group in self.param_groups:
            self._warn_precision([p for g, i, p in new if g is group], group)

    def _check_not_flat_partition(self, group: dict, index: int, p: torch.Tensor) -> None:
        """Refuse a plain 1-d tensor swapped into a row-layout group after construction: that is how DeepSpeed
        ZeRO hands an optimizer its flat partitions, whose moments the row-aligned layout would keep in fp32
        (1-d tensors have no rows): silently unquantized. A user's own 1-d parameters are ``nn.Parameter``s, or
        are given at construction."""
        if (p.ndim != 1 or group.get("flat_layout", False) or not group["quantize_states"]
                or isinstance(p, torch.nn.Parameter) or D.is_dtensor(p)):
            return
        name = param_name(group, index, p, self.param_groups)
        where = (f"flashdist: {name}, a plain 1-d tensor, was put into a param group built for row-aligned 8-bit "
                 "moments (as DeepSpeed ZeRO does with its flat partitions)")
        if self.whole_matrices:
            raise ValueError(f"{where}: {type(self).__name__} cannot run under DeepSpeed ZeRO (its flat partitions "
                             "hold no whole matrices for Newton-Schulz); train it with FSDP2 or in one process")
        raise ValueError(f"{where}, where its moments would stay fp32: build the optimizer with flat_layout=True, "
                         "or name it in the DeepSpeed config (\"type\": \"FlashAdamW\") and call "
                         "flashdist.integrations.deepspeed.initialize (or register() before Accelerate or the "
                         "Trainer starts DeepSpeed)")

    def _ensure_trainable_state(self) -> None:
        """State for every parameter that requires a gradient (one unfrozen since the last step may have
        none yet): before a state dict is taken, so that every rank saves the same keys (dcp.save)."""
        self.sync_state()
        for group in self.param_groups:
            if not group.get("flat_layout", False):
                for p in group["params"]:
                    if p.requires_grad and not self._state_ready(p, group):
                        self._init_state(p, group)
                        self._invalidate_plans()

    def _forget(self, params: list[torch.Tensor]) -> None:
        """Drop the state of ``params`` (loaded, never stepped): the next step makes the same again, so that
        the optimizer holds no state before its first step, as torch.optim holds none."""
        if params:
            for p in params:
                self.state.pop(p, None)
                self._written.pop(id(p), None)
                self._rho_dtypes.pop(p, None)
            self._invalidate_plans()

    def ensure_state(self, p: torch.Tensor, group: dict | None = None) -> None:
        """Create whatever part of ``p``'s state its group's layout needs and ``p`` lacks: ``step``, the
        moments (8-bit codes and scales, or fp32) and ``rho``; nothing when it is complete. State that a
        loader wrote straight into ``optimizer.state`` is adopted: a plain-number ``step`` becomes a tensor,
        float moments where codes belong are quantized (DeepSpeed's universal checkpoints load that way).

        ``group``: the param group whose layout applies, one of ``param_groups``; by default the one that
        holds ``p``. Pass it for a tensor the group holds only during its step (DeepSpeed ZeRO-3's flat
        partitions). Cached step plans that held ``p``'s old state tensors are dropped.

        A loader that writes ``p``'s weights and its rho together calls this first: the weights ``p`` holds at
        its next step are then taken as the ones its state belongs to, not as a write from outside the
        optimizer (which would reset rho: :meth:`adopt_outside_writes`)."""
        if group is None:
            group = self._group_of(p)
        elif not any(g is group for g in self.param_groups):
            raise ValueError("flashdist: ensure_state takes one of this optimizer's param_groups as group")
        before = {k: id(v) for k, v in self.state.get(p, {}).items()}
        self._init_state(p, group)
        if id(p) in self._plan_keys:
            self._invalidate_plans()  # (its plan's record of p's version goes to self._written, then away)
        elif {k: id(v) for k, v in self.state[p].items()} != before:
            self._invalidate_plans()
        self._written.pop(id(p), None)

    def _init_state(self, p: torch.Tensor, group: dict) -> None:
        """Create the missing parts of ``p``'s state. Called by the first step of ``p``, by ``state_dict`` for
        every trainable parameter (every rank, so that a checkpoint saved before the first step has the same
        keys on every rank: dcp.save) and by loads.

        It also adopts state that a loader wrote straight into ``self.state`` without ``load_state_dict``
        (DeepSpeed's universal checkpoints: a plain-number ``step`` and float ``exp_avg``/``exp_avg_sq`` of
        the parameter's shape): float moments where codes belong are quantized and dropped."""
        state = self.state[p]
        shape = tuple(D.global_shape(p))
        lp = D.local(p)
        step = state.get("step")
        if not isinstance(step, torch.Tensor):
            state["step"] = torch.tensor(float(step or 0.0))
        layout = MomentLayout.of(shape, group.get("flat_layout", False)) if group["quantize_states"] else None
        for name in self.moments_of(group):
            loaded = state.get(name)
            if loaded is not None and tuple(loaded.shape) != shape:
                raise ValueError(f"flashdist: state '{name}' of a parameter of shape {shape} has shape "
                                 f"{tuple(loaded.shape)}: it was written for another parameter layout")
            if layout is None:
                if loaded is None:
                    state[name] = D.state_like(p, torch.zeros_like(lp, dtype=torch.float32), shape)
                elif loaded.dtype != torch.float32:
                    state[name] = loaded.float()
                continue
            if not QuantizedMoment.held_in(state, name):
                QuantizedMoment.zeros(name, p, layout, group["companded"]).store(state)
            if loaded is not None:
                moment = QuantizedMoment.from_state(state, name, flat=layout.flat, companded=group["companded"])
                moment.quantize_(D.local(loaded).to(lp.device, torch.float32))
                del state[name]
        if R.splits(p.dtype, group["master_weight_bits"]) and "rho" not in state:
            rho_dtype = R.rho_dtype(group["master_weight_bits"])
            state["rho"] = D.state_like(p, torch.zeros_like(lp, dtype=rho_dtype), shape)
            self._rho_dtypes[p] = p.dtype

    def _check_state_shapes(self, group: dict, params: list[torch.Tensor]) -> None:
        """Refuse, naming it, a parameter whose state was made for another shape (``p.data = ...`` with a tensor
        of another shape keeps the Parameter and its state): its moments, codes and rho must have its shape."""
        names = {"rho", *self.moments_of(group), *map(QuantizedMoment.codes_key, self.moments_of(group))}
        for p in params:
            shape = tuple(D.global_shape(p))
            for key, value in (self.state.get(p) or {}).items():
                if key in names and isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                    raise ValueError(f"flashdist: {self._name(group, p)} has state '{key}' of shape "
                                     f"{tuple(value.shape)}, made for another shape (p.data replaced by a tensor of "
                                     "another shape after its first step?): build a new optimizer for it")

    def _adopt_all_casts(self) -> None:
        """``_adopt_casts`` for every parameter with state, before a state dict is made or loaded: the saved
        rho then belongs to the saved parameter dtypes."""
        changed = False
        for group in self.param_groups:
            held = [p for p in group["params"] if isinstance(p, torch.Tensor) and self.state.get(p)]
            changed |= self._adopt_casts(group, held)
        if changed:
            self._invalidate_plans()

    def _adopt_casts(self, group: dict, params: list[torch.Tensor], plan=None) -> bool:
        """Bring the state of parameters cast since their rho was made (``module.to(dtype)`` changes their dtype
        in place, keeping the Parameter) to their dtype: from 16 bits to fp32, the master weight (the old
        parameter plus rho) goes into the parameter and rho goes; between bf16 and fp16 rho restarts at 0 (it
        counts steps of the old spacing); from fp32 to 16 bits ``_init_state`` adds a zero rho. Where the cast
        rounded (to 16 bits), the cast value is the master weight from then on: one PrecisionWarning says so.
        The dtype rho belongs to is recorded when it is made (``_rho_dtypes``); ``plan``: the step plan these
        parameters had, whose dtypes tell an fp32 parameter cast to 16 bits. Whether anything changed."""
        was = dict(zip(map(id, plan.params), plan.dtypes)) if plan is not None else {}
        rounded, changed = [], False
        for p in params:
            state = self.state.get(p)
            rho = state.get("rho") if state else None
            if rho is None:  # fp32 -> 16 bits after a step: _init_state adds a zero rho
                if state and was.get(id(p)) is torch.float32 and R.splits(p.dtype, group["master_weight_bits"]):
                    rounded.append(p)
                continue
            old = self._rho_dtypes.get(p)
            if old is p.dtype or (old is None and p.dtype in (torch.bfloat16, torch.float16)):
                continue  # (None: state loaded straight into optimizer.state, taken as the parameter's dtype)
            changed = True
            if R.splits(p.dtype, group["master_weight_bits"]):  # bf16 <-> fp16
                D.local(rho).zero_()
                self._rho_dtypes[p] = p.dtype
                rounded.append(p)
                continue
            if old is not None:  # 16 bits -> fp32: the exact master weight, rho merged in
                local = D.local(p)
                with torch.no_grad():
                    local.copy_(R.merge(local.detach().to(old), D.local(rho)))
            else:  # (16 bits unknown: the cast value)
                rounded.append(p)
            del state["rho"]
            self._rho_dtypes.pop(p, None)
        if rounded:
            warn_precision(f"flashdist: {len(rounded)} parameter(s) changed dtype after their optimizer state was "
                           f"made (model.to() after a step?), the first {self._name(group, rounded[0])}: "
                           "their master weights are the cast values from here on (cast the model before the "
                           "first step to keep them)")
        return changed

    def _state_ready(self, p: torch.Tensor, group: dict) -> bool:
        """Cheap check, once per step: does ``p`` hold exactly the state its group's layout makes?"""
        state = self.state.get(p)
        if not state or not isinstance(state.get("step"), torch.Tensor):
            return False
        quantized = group["quantize_states"] and MomentLayout.of(p.shape, group.get("flat_layout", False)) is not None
        size = 1 + sum(len(QuantizedMoment.keys(name)) if quantized else 1 for name in self.moments_of(group))
        return len(state) == size + R.splits(p.dtype, group["master_weight_bits"])
