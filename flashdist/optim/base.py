"""What every flashdist optimizer shares: parameter checks, state creation, layout, step bookkeeping."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
import warnings
import weakref
from collections import defaultdict
from typing import Any

import torch

from .. import distributed as D
from ..errors import CaptureRefused
from ..quant import rho as R
from ..quant.moment import MomentLayout, QuantizedMoment
from .layout import LAYOUT_OPTIONS, LayoutOptions
from .params import check_overlaps, check_param, param_name
from .plan import Bucket, StepPlan, versions
from .precision import (caller_stacklevel, fp32_group_warning, fsdp_low_precision_fp32, fsdp_warning,
                        warn_precision)
from .state_dict import FORMATS, export_state_dict, load_state_dict

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


# (id(optimizer), format) pairs set by FlashOptimizer.state_dict_format_override in this thread or task
_FORMAT_OVERRIDES: contextvars.ContextVar[tuple[tuple[int, str], ...]] = contextvars.ContextVar(
    "flashdist_state_dict_format_overrides", default=())


def _refuse_while_capturing(device: torch.device, why: str) -> None:
    """Refuse, before anything changes, a step being captured in a CUDA graph that would need host work a graph
    cannot replay (building plans and state, reading step counts)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise CaptureRefused(f"flashdist: the optimizer step is being captured in a CUDA graph, but {why}; run one "
                           "step with the same parameters, gradients and state before capturing (a warm-up step, as "
                           "torch.cuda.graphs requires), in an optimizer built with capturable=True")


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


def _check_format(value: Any, name: str) -> None:
    """One of the state-dict formats, or a ValueError naming ``name``."""
    if value not in FORMATS:
        raise ValueError(f"flashdist: {name} must be one of {FORMATS}, got {value!r}")


class FlashOptimizer(torch.optim.Optimizer):
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
        super().__init__(params, defaults)
        self._wrap_state()

    def _wrap_state(self) -> None:
        state = _State(self)
        state.update(self.state)
        self.state = state

    def _reset_caches(self) -> None:
        """Everything derived from ``param_groups`` and ``state`` that ``sync_state`` rebuilds (and that a
        copy or an unpickled optimizer must not inherit: plans and sets keyed by ``id()``)."""
        self._plans: dict[tuple, StepPlan] = {}
        self._plan_keys: dict[int, tuple] = {}  # id(param) -> key of the plan that holds its step counter
        self._graph = None  # the GraphedStep of a graphed optimizer, made at its first step on a GPU
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
        if params and isinstance(params[0], tuple):  # named parameters
            candidate["param_names"] = [n for n, _ in params]
            params = [p for _, p in params]
        for k, v in self.defaults.items():
            candidate.setdefault(k, v)
        self._check_hyperparameters(candidate)
        layout = LayoutOptions.from_group(candidate)
        for i, p in enumerate(params):
            check_param(candidate, i, p)
        check_overlaps([(g, i, q) for g in self.param_groups for i, q in enumerate(g["params"])]
                             + [(candidate, i, p) for i, p in enumerate(params)])
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

    # ----- state that follows param_groups ------------------------------------------------------------

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
            check_param(group, i, p)
            self._check_not_flat_partition(group, i, p)
        check_overlaps([(g, i, q) for g in self.param_groups for i, q in enumerate(g["params"])])  # (twice, too)
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
        raise ValueError(f"flashdist: {param_name(group, index, p)}, a plain 1-d tensor, was put into a param group "
                         "built for row-aligned 8-bit moments (as DeepSpeed ZeRO does with its flat partitions), "
                         "where its moments would stay fp32: build the optimizer with flat_layout=True, or name it "
                         "in the DeepSpeed config (\"type\": \"FlashAdamW\") and call "
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

    def _state_ready(self, p: torch.Tensor, group: dict) -> bool:
        """Cheap check, once per step: does ``p`` hold exactly the state its group's layout makes?"""
        state = self.state.get(p)
        if not state or not isinstance(state.get("step"), torch.Tensor):
            return False
        quantized = group["quantize_states"] and MomentLayout.of(p.shape, group.get("flat_layout", False)) is not None
        size = 1 + sum(len(QuantizedMoment.keys(name)) if quantized else 1 for name in self.moments_of(group))
        return len(state) == size + R.splits(p.dtype, group["master_weight_bits"])

    # ----- queries -------------------------------------------------------------------------------------

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
        master = R.merge(D.local(p).detach(), D.local(rho))
        return D.state_like(p, master, tuple(D.global_shape(p)))

    # ----- step ----------------------------------------------------------------------------------------

    def _check_grads(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """All checks that can fail, before anything changes. Returns the parameters with a grad and their
        grads, per group.

        Cheap by design (it runs every step): torch itself refuses a gradient of another shape, so only the
        layout (sparse) and, for DTensor parameters, the gradient's placements are checked."""
        active = []
        for group in self.param_groups:
            self.check_group(group)
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
            active.append((with_grad, grads))
        return active

    @staticmethod
    def _name(group: dict, p: torch.Tensor) -> str:
        index = next(i for i, q in enumerate(group["params"]) if q is p)
        return param_name(group, index, p)

    def _skipped_counter(self, device: torch.device) -> torch.Tensor:
        if self.skipped is None or self.skipped.device != device:
            _refuse_while_capturing(device, "its skip counter does not exist yet")
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
        for group, (params, grads) in zip(self.param_groups, active):
            self._step_params(group, params, grads)
        return loss

    def _step_params(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor] | None = None) -> None:
        """Step these parameters of ``group`` (all have a gradient; ``grads``: their ``.grad``, when the caller
        has the list already): one functional call per bucket of one layout and one step count.

        The per-parameter bookkeeping (state lookups, local views, buckets) lives in a cached plan, so that a
        step over thousands of tensors costs a few list operations in Python: the plan is reused while the
        same parameters have gradients and their state is unchanged, and rebuilt otherwise."""
        if not params:
            return
        self._check_layout_unchanged(group)  # (step() checked already; gradient release steps through here)
        key = (id(group), len(params), id(params[0]))
        plan = self._plans.get(key)
        if plan is None or not plan.matches(self, params):
            _refuse_while_capturing(D.local(params[0]).device, "its plan is new (first step, or the parameters with "
                                    "gradients, their state or optimizer.capturable changed)")
            if self._groups_changed():  # (gradient release steps through here, not through step())
                self.sync_state()
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
        if not plan.capturable:  # its step counts live on the host: a graph would replay the first one's
            _refuse_while_capturing(D.local(params[0]).device, "the optimizer is not capturable (build it with "
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
            _refuse_while_capturing(D.local(params[0]).device, "its parameters are at different step counts")
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

    # ----- weights written outside the optimizer -------------------------------------------------------

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
                _refuse_while_capturing(D.local(p).device, "a parameter was written outside the optimizer since the last "
                                        "step (its rho must be reset first)")
                D.local(rho).zero_()
                reset += 1
        return reset

    @torch.no_grad()
    def adopt_outside_writes(self) -> int:
        """Make every parameter written outside the optimizer since the optimizer last wrote it (its tensor's
        version counter moved: ``copy_``, ``load_state_dict``, ``torch.nn.init``, SWA's copy-back) its own
        master weight: its rho is reset to 0, so the next step and :meth:`master_weight` start from the new
        weights. Returns how many were reset. ``step()`` does this for the parameters it steps (one list
        comparison per group), ``state_dict()`` and :meth:`master_weight` for all; call it yourself after
        writing weights while steps are replayed from a CUDA graph (a replay runs no Python). Writes through
        ``p.data`` (its own version counter) are not seen."""
        recorded = self._recorded_versions()
        params = [p for g in self.param_groups if not g.get("flat_layout", False) for p in g["params"]
                  if id(p) in recorded]
        return self._reset_written_outside(params, [recorded[id(p)] for p in params])

    # ----- state dict ----------------------------------------------------------------------------------

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
            packed = {k: v for k, v in group.items() if k != "params"}
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

    # ----- copies, pickling, torch.compile ------------------------------------------------------------

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer pickles defaults, state and param_groups only; the settings ride along,
        # the caches (plans and sets keyed by id(), which a copy would get stale) are rebuilt on arrival
        state = super().__getstate__()
        state.update(backend=self.backend, state_dict_format=self.state_dict_format, skipped=self.skipped,
                     _precision_warned=self._precision_warned, _graph_warned=self._graph_warned,
                     capturable=self.capturable,
                     graphed=self.graphed)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._wrap_state()
        self._reset_caches()
        self.sync_state()

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


