"""How an optimizer's state leaves it and comes back: ``state_dict`` (in a chosen format), its per-thread
format override, ``load_state_dict``, copies and pickling. The formats themselves live in
flashdist.optim.state_dict. A mixin of FlashOptimizer."""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from typing import Any

import torch

from .lifecycle import _fresh
from .state_dict import FORMATS, export_state_dict, load_state_dict

# (id(optimizer), format) pairs set by FlashOptimizer.state_dict_format_override in this thread or task
_FORMAT_OVERRIDES: contextvars.ContextVar[tuple[tuple[int, str], ...]] = contextvars.ContextVar(
    "flashdist_state_dict_format_overrides", default=())


def _check_format(value: Any, name: str) -> None:
    """One of the state-dict formats, or a ValueError naming ``name``."""
    if value not in FORMATS:
        raise ValueError(f"flashdist: {name} must be one of {FORMATS}, got {value!r}")


def _plain(value):
    """A NumPy scalar as the Python number it holds (it has ``item``), a tuple or list of them likewise; any
    other value as it is."""
    if isinstance(value, (tuple, list)):
        return type(value)(map(_plain, value))
    if isinstance(value, numbers.Number) and not isinstance(value, (int, float, complex)) and hasattr(value, "item"):
        return value.item()
    return value


class StateIO:
    """FlashOptimizer's state dicts, copies and pickling."""

    @torch._disable_dynamo
    def state_dict(self, *, format: str | None = None) -> dict:
        """torch's state dict in ``format``: "portable" (fp32 moments under torch.optim.AdamW's names, plus
        rho) or "compressed" (codes, scales, rho); see flashdist.optim.state_dict. Without ``format``: the
        format set by an enclosing :meth:`state_dict_format_override`, else ``state_dict_format`` (the
        optimizer's setting, "portable" by default), which this never changes. Every trainable parameter has
        state in it, stepped or not (dcp.save needs the same keys on every rank); frozen parameters never
        stepped have none, as in torch.optim. Hooks run as in torch.optim: ``register_state_dict_pre_hook``
        hooks before, ``register_state_dict_post_hook`` hooks on the dict that is returned (and may replace
        it)."""
        if format is None:
            format = next((f for i, f in _FORMAT_OVERRIDES.get() if i == id(self)), self.state_dict_format)
        else:
            _check_format(format, "state_dict's format")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._adopt_all_casts()  # (parameters cast since their rho was made: rho follows first)
        self._ensure_trainable_state()
        self.adopt_outside_writes()  # (a saved rho belongs to the weights saved beside it)
        state_dict = export_state_dict(self, self._packed_state_dict(), format)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _packed_state_dict(self) -> dict:
        """torch.optim.Optimizer.state_dict's packing (parameters numbered in group order, state keyed by
        those numbers), without its hooks: they must see the exported dict."""
        index: dict[int, int] = {}
        groups = []
        start = 0
        for group in self.param_groups:
            # (a NumPy scalar a group was given, or a schedule set, as the Python number: torch.load's
            # weights_only=True, DCP's loader included, refuses NumPy objects)
            packed = {k: _plain(v) for k, v in group.items() if k != "params"}
            index.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in index})
            packed["params"] = [index[id(p)] for p in group["params"]]
            start += len(packed["params"])
            groups.append(packed)
        state = {(index[id(k)] if isinstance(k, torch.Tensor) else k): v for k, v in self.state.items()}
        return {"state": state, "param_groups": groups}

    @contextlib.contextmanager
    def state_dict_format_override(self, format: str):
        """Within this block, ``state_dict()`` calls on this optimizer that pass no ``format`` (as
        torch.distributed.checkpoint's ``get_optimizer_state_dict`` calls it) return ``format``. The
        optimizer's ``state_dict_format`` stays as it is, and the override holds for the calling thread (or
        asyncio task) only: a checkpoint saved from another thread meanwhile keeps the optimizer's format.
        flashdist.checkpoint.dcp.load reads a checkpoint in the format it was saved in this way."""
        _check_format(format, "state_dict_format_override's format")
        token = _FORMAT_OVERRIDES.set(((id(self), format),) + _FORMAT_OVERRIDES.get())
        try:
            yield self
        finally:
            _FORMAT_OVERRIDES.reset(token)

    def _check_saved_group(self, index: int, saved: dict) -> None:
        """Refuse a param group of a state dict that another kind of optimizer saved, where the state keys
        alone would not tell (a class whose state is named as another's); nothing by default."""

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a portable, compressed or torch.optim.AdamW state dict, keeping int8/uint8/bf16 state in its
        dtype (torch's Optimizer would cast it to the parameter dtype). Shapes, dtypes, format version and
        master_weight_bits are checked for every parameter before anything is copied: a mismatch raises an
        error naming the parameter and leaves the optimizer unchanged. A state dict without rho (e.g.
        torch.optim.AdamW's) keeps the current rho: set the fp32 weights with
        flashdist.load_fp32_state_dict. ``register_load_state_dict_pre_hook`` hooks run first (and may
        replace the dict), ``register_load_state_dict_post_hook`` hooks after the load, as in torch.optim."""
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.sync_state()
        self._adopt_all_casts()  # (the live state made for the parameters' dtypes now, as the loaded one)
        self._invalidate_plans()
        had_state = {id(p) for p, s in self.state.items() if s}
        try:
            load_state_dict(self, state_dict)
            # the loaded rho belongs to the weights the parameters hold at their next step (a checkpoint load
            # copies the model's weights before or after this): no earlier record applies
            self._written.clear()
            # a never-stepped state loaded (Accelerate's prepare round-trips the state dict of a new optimizer;
            # a checkpoint saved before the first step) is the state the first step makes: keep none until then
            # (torch's DCP loader reads the keys a state dict made, so a state dict alone keeps its state)
            self._forget([p for p, s in list(self.state.items()) if _fresh(s)])
        except BaseException:
            for p in [p for p in self.state if id(p) not in had_state]:
                del self.state[p]  # a refused load leaves no state it made for the checks behind
            raise
        finally:
            self._invalidate_plans()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ----- copies and pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer pickles defaults, state and param_groups only; the settings ride along,
        # the caches (plans and sets keyed by id(), which a copy would get stale) are rebuilt on arrival
        state = super().__getstate__()
        state.update(backend=self.backend, state_dict_format=self.state_dict_format, skipped=self.skipped,
                     _precision_warned=self._precision_warned, _graph_warned=self._graph_warned,
                     capturable=self.capturable,
                     graphed=self.graphed, _rho_dtypes=self._rho_dtypes)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_rho_dtypes", {})  # (an optimizer pickled by an earlier version)
        super().__setstate__(state)
        self._wrap_state()
        self._reset_caches()
        self.sync_state()
