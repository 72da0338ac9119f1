"""Weights written outside the optimizer (``model.load_state_dict``, SWA's copy-back, ``torch.nn.init``):
each parameter's version counter as the optimizer last wrote it, and the rho reset that makes such weights
their own master. A mixin of FlashOptimizer; a live step plan keeps its own record (StepPlan.versions)."""

from __future__ import annotations

import torch

from .. import distributed as D
from .plan import StepPlan, refuse_while_capturing, versions


class OutsideWrites:
    """FlashOptimizer's record of its own writes to the parameters, and what it does about others'."""

    def _flush_versions(self, plan: StepPlan | None) -> None:
        """Keep a plan's record of its parameters' versions in ``self._written`` (the plan is dropped)."""
        if plan is not None and plan.versions is not None:
            self._written.update(zip(map(id, plan.params), plan.versions))

    def _recorded_versions(self) -> dict[int, int]:
        """id(param) -> its local tensor's version after the optimizer's last write, for every parameter."""
        recorded = dict(self._written)
        for plan in self._plans.values():
            if plan.versions is not None:
                recorded.update(zip(map(id, plan.params), plan.versions))
        return recorded

    def _recorded_version(self, p: torch.Tensor) -> int | None:
        key = self._plan_keys.get(id(p))
        plan = self._plans.get(key) if key is not None else None
        if plan is not None and plan.versions is not None:
            return plan.versions[plan.position(p)]
        return self._written.get(id(p))

    def _record_version(self, p: torch.Tensor, version: int) -> None:
        key = self._plan_keys.get(id(p))
        plan = self._plans.get(key) if key is not None else None
        if plan is not None and plan.versions is not None:
            plan.versions[plan.position(p)] = version
        if id(p) in self._written:
            self._written[id(p)] = version

    def _reset_written_outside(self, params, recorded) -> int:
        """Reset to 0 the rho of each parameter whose version moved since ``recorded`` (None: no record): the
        weights written there (``model.load_state_dict``, SWA's copy-back, ``torch.nn.init``) are their own
        master now, and an old rho added to them would move them by up to one bf16 spacing."""
        reset = 0
        for p, was, now in zip(params, recorded, versions(params)):
            if was is None or was == now:
                continue
            self._record_version(p, now)
            rho = self.state.get(p, {}).get("rho")
            if rho is not None:
                refuse_while_capturing(D.local(p).device, "a parameter was written outside the optimizer since the last "
                                       "step (its rho must be reset first)")
                D.local(rho).zero_()
                reset += 1
        return reset

    def _adopt_outside_writes_of_plans(self) -> None:
        """``step()``'s check for every live plan at once (one list comparison per plan): GraphedStep runs it
        before each replay, which runs no Python of the step."""
        for plan in list(self._plans.values()):
            if plan.versions is not None and versions(plan.watched) != plan.versions:
                self._reset_written_outside(plan.params, plan.versions)

    @torch.no_grad()
    def adopt_outside_writes(self) -> int:
        """Make every parameter written outside the optimizer since the optimizer last wrote it (its tensor's
        version counter moved: ``copy_``, ``load_state_dict``, ``torch.nn.init``, SWA's copy-back) its own
        master weight: its rho is reset to 0, so the next step and :meth:`master_weight` start from the new
        weights. Returns how many were reset. ``step()`` does this for the parameters it steps (one list
        comparison per group), ``state_dict()`` and :meth:`master_weight` for all, and :class:`GraphedStep`
        before each replay; call it yourself after writing weights between replays of a graph you captured
        yourself (a replay runs no Python). Writes through ``p.data`` (its own version counter) are not seen."""
        recorded = self._recorded_versions()
        params = [p for g in self.param_groups if not g.get("flat_layout", False) for p in g["params"]
                  if id(p) in recorded]
        return self._reset_written_outside(params, [recorded[id(p)] for p in params])
