"""FlashOptimizer, the base of every flashdist optimizer: construction (parameter and hyper-parameter checks,
layout options), queries (master weights) and the fused step over cached plans. Its other jobs are mixins:
state that follows ``param_groups`` (optim/lifecycle.py), weights written outside the optimizer
(optim/outside_writes.py), state dicts, copies and pickling (optim/state_io.py)."""

from __future__ import annotations

import itertools
import operator
import warnings
from collections import defaultdict

import torch

from .. import distributed as D
from ..quant import rho as R
from .layout import LAYOUT_OPTIONS, LayoutOptions
from .lifecycle import StateLifecycle, _synced_entry
from .outside_writes import OutsideWrites
from .params import check_flat_storage, check_names, check_overlaps, check_param, check_unimplemented, param_name
from .plan import Bucket, StepPlan, refuse_while_capturing, versions
from .precision import (caller_stacklevel, fp32_group_warning, fsdp_low_precision_fp32, fsdp_warning,
                        warn_precision)
from .state_io import StateIO, _check_format

# Public names that lived in this module before they moved; their old import path keeps working.
from ..quant.moment import state_layout  # noqa: F401,E402
from .layout import MASTER_WEIGHT_BITS  # noqa: F401,E402
from .params import SUPPORTED_PARAM_DTYPES, check_betas, check_number  # noqa: F401,E402
from .precision import PrecisionWarning  # noqa: F401,E402

_GRAD = operator.attrgetter("grad")
_GENERATIONS = itertools.count()
_LAYOUT = operator.attrgetter("layout")


_EAGER_STEP = ("flashdist: the optimizer step runs eagerly (it is one fused launch per param group already); "
               "call torch.compile without fullgraph=True, or leave optimizer.step out of the compiled function")


class FlashOptimizer(StateLifecycle, OutsideWrites, StateIO, torch.optim.Optimizer):
    """Base class. Subclasses set ``_moments`` (state names of their moments, e.g. ("exp_avg", "exp_avg_sq"),
    or override ``moments_of`` when a group's hyper-parameters decide them) and implement
    ``_check_hyperparameters`` and ``_step_bucket``.

    Beyond torch.optim.Optimizer's API, the methods that checkpointing, gradient release and framework
    integrations build on: :meth:`ensure_state`, :meth:`step_parameters`, :meth:`check_group`,
    :meth:`clear_plans`, :meth:`layout_options`, ``state_dict(format=...)`` and :attr:`keeps_step_count`.

    State is made no earlier than torch.optim makes it: at a parameter's first step, or when ``state_dict``,
    ``load_state_dict`` or :meth:`ensure_state` needs it. Before the first step the optimizer holds no state
    and no strong reference to the parameters beyond ``param_groups`` (frameworks swap them after
    construction: Accelerate's FSDP2 ``prepare`` puts sharded DTensors in place of the unsharded tensors,
    which are then freed). ``state_dict()`` before the first step makes the (zero) state of every trainable
    parameter, so that every rank saves the same keys (dcp.save). A parameter no longer in any group loses
    its state, and frozen parameters (``requires_grad=False``) hold none until they are stepped. Each step
    compares each group's dict and parameter list object with those last seen (no Python work per
    parameter); an entry replaced in place is caught by the step's cached plan, which compares the
    parameters with gradients by identity anyway, and by ``state_dict``."""

    _moments: tuple[str, ...] = ()
    keeps_step_count: bool = True
    """Whether the torch optimizer this one replaces keeps ``state["step"]`` (torch.optim.SGD does not): a
    state dict of that optimizer without a ``step`` then loads as one step taken."""
    whole_matrices: bool = False  # the update needs each matrix whole (FlashMuon): no flat partitions (ZeRO)

    def __init__(self, params, defaults: dict, *, backend: str = "auto", state_dict_format: str = "portable",
                 capturable: bool = False, graphed: bool = False):
        from ..functional.backend import BACKENDS

        if backend not in BACKENDS:
            raise ValueError(f"flashdist: backend must be one of {BACKENDS}, got {backend!r}")
        _check_format(state_dict_format, "state_dict_format")
        for name, value in (("graphed", graphed), ("capturable", capturable)):
            if not isinstance(value, bool):
                raise ValueError(f"flashdist: {name} must be True or False, got {value!r}")
        self.backend = backend
        self.state_dict_format = state_dict_format
        # step counts and scalars on the GPU (optim/plan.py), read when it runs; graphed implies it
        self.capturable = capturable or graphed
        self.graphed = graphed
        self.skipped = None  # int32 counter of skipped (non-finite) groups, on the parameters' device
        self._precision_warned = False
        self._graph_warned = False  # graphed=True had no effect on a step, and a warning said so
        self._reset_caches()
        # param -> the dtype its rho counts steps of (the parameter's when rho was made): a parameter cast since
        # (module.to() keeps the Parameter) is adopted from it (_adopt_casts); copies and pickles carry it
        self._rho_dtypes: dict[torch.Tensor, torch.dtype] = {}
        super().__init__(params, defaults)
        self._wrap_state()

    def _reset_caches(self) -> None:
        """Everything derived from ``param_groups`` and ``state`` that ``sync_state`` rebuilds (and that a
        copy or an unpickled optimizer must not inherit: plans and sets keyed by ``id()``)."""
        self._plans: dict[tuple, StepPlan] = {}
        self._plan_keys: dict[int, tuple] = {}  # id(param) -> key of the plan that holds its step counter
        self._graph = None  # the GraphedStep of a graphed optimizer, made at its first step on a GPU
        # while a GraphedStep captures: (parameters, device cells, gradient dtypes) of each launch that reads its
        # gradients' addresses from cells (FlashMuon's Muon matrices), which GraphedStep writes before a replay
        self._grad_cells: list | None = None
        self._no_graph_at = None  # plan_generation when one could not be made (parameters on the CPU, ...)
        # changes whenever a step plan is dropped or made (so do the tensors a captured step reads): GraphedStep
        self.plan_generation = next(_GENERATIONS)
        self._dtensor_groups: set[int] = set()  # ids of param groups that hold DTensor parameters
        self._layouts: dict[int, LayoutOptions] = {}  # id(group) -> its layout options when its state was made
        # (group, id of its params list, weak references to its parameters) as last seen: weak, so that the
        # tensors a framework swapped out (Accelerate's unsharded parameters) are freed at once
        self._synced: list[tuple[dict, int, list]] = []
        # ids of tensors seen in flat_layout groups: their state is never freed by sync_state, because
        # DeepSpeed ZeRO-3 puts each sub-group's partition into the group for its step and empties the group
        # after it (the state of a tensor holds that tensor, so its id stays its own while it has state)
        self._flat_ids: set[int] = set()
        # id(param) -> version counter of its local tensor after the optimizer last wrote it, for parameters
        # whose plan is gone (a live plan keeps its own list, StepPlan.versions); see _adopt_outside_writes
        self._written: dict[int, int] = {}

    def moments_of(self, group: dict) -> tuple[str, ...]:
        """State names of the moments the parameters of ``group`` keep (fp32 under these names, or as a
        ``flashdist.quant.moment.QuantizedMoment``)."""
        return self._moments

    # ----- construction -------------------------------------------------------------------------------

    def _check_hyperparameters(self, group: dict) -> None:
        raise NotImplementedError

    def check_group(self, group: dict) -> None:
        """Raise a ValueError naming the first hyper-parameter of ``group`` (a param-group dict, live or
        about to be set) that this optimizer would refuse, or the layout option changed on a live group
        since its state was made; return None when all is well. ``step()`` runs it on every group; call
        it before stepping through :meth:`step_parameters`. Changes nothing."""
        check_unimplemented(group, type(self).__name__)
        self._check_hyperparameters(group)
        self._check_layout_unchanged(group)

    def layout_options(self, group: dict) -> LayoutOptions:
        """The layout options the state of ``group`` (one of ``param_groups``) is made with: fixed from the
        group's construction on, whatever its dict says now."""
        known = self._layouts.get(id(group))
        if known is None:
            if not any(g is group for g in self.param_groups):
                raise KeyError("flashdist: layout_options takes one of this optimizer's param_groups")
            self.sync_state()  # a group dict put into param_groups directly: recorded here
            known = self._layouts[id(group)]
        return known

    def _check_layout_unchanged(self, group: dict) -> None:
        known = self._layouts.get(id(group))
        if known is not None and not known.matches(group):  # (a group not seen yet: sync_state records it)
            was = known.as_dict()
            now = {k: group.get(k, False) for k in LAYOUT_OPTIONS}
            changed = {k: (was[k], now[k]) for k in was if was[k] != now[k]}
            raise ValueError(f"flashdist: layout options of a param group changed after its state was made "
                             f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}); they decide "
                             "the state's layout and are fixed: set them back, or build a new optimizer with "
                             "the options you want")

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``: ``params`` may be a tensor or any iterable of tensors
        or of ``(name, tensor)`` pairs (``named_parameters()``), generators included. Every check runs
        before anything changes, so a refused group leaves the optimizer as it was."""
        if not isinstance(param_group, dict):
            raise TypeError(f"flashdist: a param group must be a dict, got {type(param_group).__name__}")
        given = param_group.get("params")
        if given is None:
            raise ValueError("flashdist: a param group needs a 'params' entry")
        if isinstance(given, set):
            raise TypeError("flashdist: a param group's params must be an ordered collection (a list, a tuple or "
                            "a generator), not a set: the order of a set changes between runs")
        # Materialize once: a generator is consumed here and torch must be handed the same tensors.
        entries = [given] if isinstance(given, torch.Tensor) else list(given)
        if not entries and iter(given) is given:
            raise ValueError("flashdist: a param group's params is an iterator that yields no parameters (a "
                             "generator such as model.parameters() already consumed?); pass a fresh generator "
                             "or a list")
        param_group = {**param_group, "params": entries}
        candidate = dict(param_group)
        params = entries
        if check_names(params, len(self.param_groups)):  # named parameters
            candidate["param_names"] = [n for n, _ in params]
            params = [p for _, p in params]
        for k, v in self.defaults.items():
            candidate.setdefault(k, v)
        check_unimplemented(candidate, type(self).__name__)
        self._check_hyperparameters(candidate)
        layout = LayoutOptions.from_group(candidate)
        for i, p in enumerate(params):
            check_param(candidate, i, p, [*self.param_groups, candidate])
        check_overlaps([(g, i, q) for g in self.param_groups for i, q in enumerate(g["params"])]
                       + [(candidate, i, p) for i, p in enumerate(params)], [*self.param_groups, candidate])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if len(group["params"]) != len(params):
            self.param_groups.pop()
            raise ValueError(f"flashdist: a param group given {len(params)} parameters ended up with "
                             f"{len(group['params'])}; pass the parameters as a list")
        self._layouts[id(group)] = layout
        if any(D.is_dtensor(p) for p in group["params"]):
            self._dtensor_groups.add(id(group))
        self._synced.append(_synced_entry(group))
        self._warn_precision(group["params"], group)
        if group.get("flat_layout", False):
            # A wrapper (DeepSpeed ZeRO) replaces these tensors by its flat partitions after construction.
            self._flat_ids.update(map(id, group["params"]))
        # no state yet: it is made at the first step (or state_dict, load, ensure_state), as torch.optim makes it

    def _warn_precision(self, params, group: dict) -> None:
        """Say once that fp32 parameters get no 24-bit split (flashdist.optim.precision.fp32_group_warning)."""
        if not self._precision_warned:
            self._precision_warned = warn_precision(fp32_group_warning(type(self).__name__, params, group))

    def check_precision(self, model: torch.nn.Module) -> list[str]:
        """The trainable fp32 parameters of this optimizer that FSDP2 computes in bf16 or fp16 (a
        ``MixedPrecisionPolicy(param_dtype=...)`` in ``model``; Accelerate's FSDP2 mixed precision sets one
        and upcasts the parameters): they get fp32 gradients and no 24-bit split. Warns once (a
        ``PrecisionWarning``, whatever ``master_weight_bits``) when there are any; returns their names (FQNs
        in ``model``). Call it after the model is sharded, e.g. after ``accelerator.prepare``."""
        found = fsdp_low_precision_fp32(self.param_groups, model)
        if found and not self._precision_warned:
            self._precision_warned = warn_precision(fsdp_warning(type(self).__name__, found))
        return found

    # ----- queries ------------------------------------------------------------------------------------

    def _group_of(self, p: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("flashdist: this tensor is not a parameter of the optimizer")

    @torch.no_grad()
    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weight of ``p``: the bf16/fp16 parameter plus its rho correction (``p`` itself,
        as fp32, when it has no rho: fp32 parameters or ``master_weight_bits=None``). For a DTensor
        parameter the result is a DTensor with the same placements."""
        self._group_of(p)
        rho = self.state.get(p, {}).get("rho")
        was = self._recorded_version(p) if rho is not None else None
        if rho is None or (was is not None and was != p._version):  # (written outside: its own master)
            return p.detach().float()
        cast_from = self._rho_dtypes.get(p)  # (cast since rho was made: what its next step takes)
        if cast_from is not None and cast_from is not p.dtype:
            if p.dtype in (torch.bfloat16, torch.float16) or cast_from not in (torch.bfloat16, torch.float16):
                return p.detach().float()
            return D.state_like(p, R.merge(D.local(p).detach().to(cast_from), D.local(rho)), tuple(p.shape))
        master = R.merge(D.local(p).detach(), D.local(rho))
        return D.state_like(p, master, tuple(D.global_shape(p)))

    # ----- step ---------------------------------------------------------------------------------------

    def _check_grads(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """All checks that can fail, before anything changes. Returns the parameters with a grad and their
        grads, per group.

        Cheap by design (it runs every step): torch itself refuses a gradient of another shape, so only the
        layout (sparse), contiguity where the step reads flat storage and, for DTensor parameters, the gradient's
        placements are checked."""
        active = []
        for index, group in enumerate(self.param_groups):
            try:
                self.check_group(group)
            except ValueError as error:
                said = str(error)  # (re-raised as it is: one group, not ours, or it names the group already)
                if len(self.param_groups) == 1 or not said.startswith("flashdist: ") or "param_groups[" in said:
                    raise
                raise ValueError(f"flashdist: param_groups[{index}]: {said[len('flashdist: '):]}") from None
            params = group["params"]
            grads = list(map(_GRAD, params))
            if all(map(operator.is_not, grads, itertools.repeat(None))):
                with_grad = list(params)
            else:
                with_grad = [p for p, g in zip(params, grads) if g is not None]
                grads = [g for g in grads if g is not None]
            if set(map(_LAYOUT, grads)) - {torch.strided}:
                p = next(p for p in with_grad if p.grad.layout is not torch.strided)
                raise RuntimeError(f"flashdist: {self._name(group, p)} has a sparse gradient; flashdist "
                                   "optimizers need dense gradients (e.g. nn.Embedding(sparse=False))")
            if id(group) in self._dtensor_groups:
                for p in with_grad:
                    problem = D.grad_layout_problem(p, p.grad) if D.is_dtensor(p) else None
                    if problem:
                        raise RuntimeError(f"flashdist: {self._name(group, p)} {problem}")
            check_flat_storage(group, with_grad, grads, self.backend, id(group) in self._dtensor_groups,
                               self._name)
            active.append((with_grad, grads))
        return active

    def _name(self, group: dict, p: torch.Tensor) -> str:
        index = next(i for i, q in enumerate(group["params"]) if q is p)
        return param_name(group, index, p, self.param_groups)

    def _skipped_counter(self, device: torch.device) -> torch.Tensor:
        if self.skipped is None or self.skipped.device != device:
            refuse_while_capturing(device, "its skip counter does not exist yet")
            self.skipped = torch.zeros((), dtype=torch.int32, device=device)
        return self.skipped

    @torch.no_grad()
    def step(self, closure=None):
        if self.graphed:
            if closure is not None:
                self._warn_not_graphed("a step with a closure runs eagerly (the closure's forward and backward "
                                       "passes cannot be replayed)")
            else:
                graph = self._graphed_step()
                if graph is not None:
                    graph()  # a replay of the captured step, pointed at this call's gradients, else _eager_step
                    return None
        return self._eager_step(closure)

    def _warn_not_graphed(self, why: str) -> None:
        """Say once per optimizer that ``graphed=True`` has no effect here, and why (steps run eagerly)."""
        if not getattr(self, "_graph_warned", False):  # (an optimizer pickled by an earlier version)
            self._graph_warned = True
            warnings.warn(f"flashdist: graphed=True has no effect on this step: {why}; it runs eagerly (said once)",
                          UserWarning, stacklevel=caller_stacklevel())

    def _graphed_step(self):
        """The GraphedStep of a ``graphed=True`` optimizer, or None where none can be made (parameters not on
        one CUDA device, a backend other than the Triton kernel): those steps run eagerly, and it is tried
        again once the parameters or their state change (Accelerate and FSDP2 move them after construction).
        It is not strict: where its checks fail later (DeepSpeed ZeRO-3 empties groups between steps), it steps
        eagerly."""
        if self._graph is None and self._no_graph_at != self.plan_generation:
            from .graph import GraphedStep  # (it reads this module's optimizers: imported when first needed)

            try:
                self._graph = GraphedStep(self, eager=self._eager_step, strict=False)
            except ValueError as e:
                self._no_graph_at = self.plan_generation
                self._warn_not_graphed(str(e).removeprefix("flashdist: ") + " (tried again when the parameters "
                                       "or their state change)")
        return self._graph

    def _eager_step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._groups_changed(thorough=False):
            self.sync_state()
        active = self._check_grads()
        # every group's plan before any group steps: a plan made anew checks what changed in place (a parameter
        # put into a group's list, p.data of another shape), so a refusal in a later group steps no earlier one
        ready = [self._plan(group, params) if params else None
                 for group, (params, _) in zip(self.param_groups, active)]
        for group, (params, grads), plan in zip(self.param_groups, active, ready):
            self._step_params(group, params, grads, plan)
        return loss

    def _plan(self, group: dict, params: list[torch.Tensor]) -> tuple[tuple, StepPlan]:
        """``(key, plan)``: the cached step plan of these parameters of ``group`` (all with a gradient), made
        anew where none matches them, after the checks a change meets (new parameters, shapes, casts) and with
        their state made; nothing is stepped."""
        self._check_layout_unchanged(group)  # (step() checked already; gradient release steps through here)
        key = (id(group), len(params), id(params[0]))
        plan = self._plans.get(key)
        if plan is None or not plan.matches(self, params):
            refuse_while_capturing(D.local(params[0]).device, "its plan is new (first step, or the parameters with "
                                   "gradients, their state or optimizer.capturable changed)")
            if self._groups_changed():  # (gradient release steps through here, not through step())
                self.sync_state()
            self._check_state_shapes(group, params)
            self._adopt_casts(group, params, plan)
            for p in params:
                if not self._state_ready(p, group):
                    self._init_state(p, group)
            self._flush_versions(plan)
            for p in params:
                old = self._plan_keys.get(id(p))
                if old is not None and old != key:
                    self._flush_versions(self._plans.get(old))
            plan = self._plans[key] = StepPlan(self, group, params)
            self.plan_generation = next(_GENERATIONS)
            if plan.watched is not None:
                self._reset_written_outside(plan.params, list(map(self._written.get, map(id, params))))
            # A parameter's step counter lives in the plan that last took it: a plan that held it before
            # (another list of parameters with gradients) keeps a stale copy, so it must not be reused.
            for p in params:
                old = self._plan_keys.get(id(p))
                if old is not None and old != key:
                    self._plans.pop(old, None)
                self._plan_keys[id(p)] = key
        return key, plan

    def _step_params(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor] | None = None,
                     ready: tuple | None = None) -> None:
        """Step these parameters of ``group`` (all have a gradient; ``grads``: their ``.grad``, when the caller
        has the list already): one functional call per bucket of one layout and one step count. ``ready``:
        ``_plan(group, params)``, when the caller made it (used while it is still the cached one).

        The per-parameter bookkeeping (state lookups, local views, buckets) lives in a cached plan, so that a
        step over thousands of tensors costs a few list operations in Python: the plan is reused while the
        same parameters have gradients and their state is unchanged, and rebuilt otherwise."""
        if not params:
            return
        if ready is None or self._plans.get(ready[0]) is not ready[1]:
            ready = self._plan(group, params)
        key, plan = ready
        if not plan.capturable:  # its step counts live on the host: a graph would replay the first one's
            refuse_while_capturing(D.local(params[0]).device, "the optimizer is not capturable (build it with "
                                   "capturable=True)")
        if plan.versions is not None and versions(plan.watched) != plan.versions:  # one list compare per step
            self._reset_written_outside(plan.params, plan.versions)
        plan.counts.add_(1.0)  # every state["step"] of the plan is a view into this one tensor
        try:
            self._step_plan(group, plan, params, grads)
        except BaseException:
            # a failure before the first launch (a check of the functional step) changed nothing: neither
            # may the step counts; the plan is rebuilt next time
            plan.counts.sub_(1.0)
            plan.step = None
            self._flush_versions(plan)
            self._plans.pop(key, None)
            self.plan_generation = next(_GENERATIONS)
            raise
        if plan.watched is not None:
            plan.versions = versions(plan.watched)  # after the optimizer's own writes (a reference step's copy_)

    @torch.no_grad()
    def step_parameters(self, group: dict, params: list[torch.Tensor],
                        grads: list[torch.Tensor] | None = None) -> None:
        """Step ``params``, parameters of ``group`` (one of ``param_groups``) that all hold a gradient, as
        ``step()`` would step them; parameters left out are not touched. ``grads``: their ``.grad`` tensors
        in the same order, when the caller has that list already. Gradient release steps each batch of
        parameters whose gradients are final this way.

        Unlike ``step()`` it runs no step hooks and no :meth:`check_group` (call it first: the group's
        hyper-parameters may have changed since the last step, e.g. by a learning-rate scheduler), and takes
        no closure. The cached plan of the fused step is kept per list of parameters: stepping the same
        lists each iteration costs no more Python work than ``step()`` does."""
        if not any(g is group for g in self.param_groups):
            raise ValueError("flashdist: step_parameters takes one of this optimizer's param_groups as group")
        given = list(grads) if grads is not None else list(map(_GRAD, params))
        if any(map(operator.is_, given, itertools.repeat(None))):
            index = next(i for i, g in enumerate(given) if g is None)
            raise ValueError(f"flashdist: step_parameters got params[{index}] (shape {tuple(params[index].shape)}) "
                             "without a gradient; pass only parameters whose gradient is set")
        self._step_params(group, params, grads)

    def _step_plan(self, group: dict, plan: "StepPlan", params: list[torch.Tensor],
                   grads: list[torch.Tensor] | None) -> None:
        if plan.step is None:  # parameters at different step counts: bucket by count (rare)
            refuse_while_capturing(D.local(params[0]).device, "its parameters are at different step counts")
            counts = [int(t) for t in plan.counts.tolist()]
            for bucket in plan.buckets:
                by_count = defaultdict(list)
                for i in bucket.index:
                    by_count[counts[i]].append(i)
                for count, index in by_count.items():
                    self._step_bucket(group, bucket.subset(index), [params[i].grad for i in index], count,
                                      self._skipped_counter(bucket.device))
            plan.step = counts[0] if len(set(counts)) == 1 else None
            return
        for bucket in plan.buckets:
            if bucket.everything:
                bucket_grads = grads if grads is not None else list(map(_GRAD, params))
            else:
                bucket_grads = [params[i].grad for i in bucket.index]
            # a capturable plan's step reads the count on the device (it was incremented there already)
            step = plan.count if plan.capturable else plan.step + 1
            self._step_bucket(group, bucket, bucket_grads, step, self._skipped_counter(bucket.device))
        plan.step += 1

    def _step_bucket(self, group: dict, bucket: "Bucket", grads: list[torch.Tensor], step: int,
                     skipped: torch.Tensor) -> None:
        raise NotImplementedError

    def clear_plans(self) -> None:
        """Forget the cached plans of the fused step (the per-parameter bookkeeping, built again by the next
        step that needs it). The optimizer clears them itself whenever its parameters or their state change
        through its methods; call it after stepping through :meth:`step_parameters` with other lists of
        parameters than ``step()`` uses, or after replacing a state tensor in ``optimizer.state`` by hand."""
        self._invalidate_plans()

    def _invalidate_plans(self) -> None:
        for plan in self._plans.values():
            self._flush_versions(plan)
        self._plans.clear()
        self._plan_keys.clear()
        self.plan_generation = next(_GENERATIONS)

    # ----- torch.compile ------------------------------------------------------------------------------

    def _patch_step_function(self) -> None:
        """Make ``step`` (torch's hook-running wrapper included) opaque to torch.compile.

        The step keeps Python-side caches (plans, bucketed tensor lists) that dynamo cannot trace, and the
        fused kernel is already one launch per group, so a compiler has nothing left to fuse. So
        ``torch.compile(optimizer.step)`` runs the step eagerly (a graph break), and a compiled function
        that calls ``optimizer.step()`` breaks its graph there. ``fullgraph=True`` forbids that break: dynamo
        then raises before anything changed, with the reason below."""
        super()._patch_step_function()
        cls = type(self)
        if not getattr(cls.step, "flashdist_eager", False):
            step = torch.compiler.disable(cls.step, recursive=True, reason=_EAGER_STEP)
            step.hooked = True  # torch's wrapper is inside: do not wrap again
            step.flashdist_eager = True
            cls.step = step
