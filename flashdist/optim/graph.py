"""``GraphedStep``: an optimizer's step captured once in a CUDA graph and replayed, with the checks that make a
replay safe and an eager step wherever one is not.

A step over thousands of tensors spends more time on the host (Python, launches) than the GPU spends on it.
A capturable flashdist optimizer (``capturable=True``: the step count and the update's scalars live on the
device) can be captured in a CUDA graph, as torch.optim's capturable optimizers can; a replay runs the whole
step with no host work. A graph holds the addresses it was captured with, but no gradient address is fixed
into it: the kernels read every gradient's address from device tables (``kernels.triton.plans``) or cells
(FlashMuon's Muon matrices, ``kernels.triton.muon``), which ``GraphedStep`` points at the gradients of the
call before each replay, outside the graph (one small host-to-device copy per table). So a replay follows
the gradients wherever ``zero_grad(set_to_none=True)`` and the next backward pass put them (torch's default,
and the Trainer's, Accelerate's and Lightning's). What must stay where it was captured is checked at every
call: the parameter addresses, the optimizer's step plans (its state), which parameters have a gradient and
their dtypes, the hyper-parameters; where any differs the call steps eagerly, and captures again once a step
sees the same. Results are the same bits either way. The parameter
addresses are compared in C++ (``flashdist.kernels.host``, built at first use: a few nanoseconds per tensor),
or in Python where it cannot be built (a few hundred).
"""

from __future__ import annotations

import itertools
import operator
import warnings

import torch

from .. import distributed as D
from ..errors import CaptureRefused
from ..kernels import host
from ..kernels.triton import plans
from .params import check_number

_GRAD = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr
_NONE = itertools.repeat(None)

# A call that steps eagerly after the warm-up (something a replay reads moved or changed) is a miss. After
# MISS_LIMIT misses in a row, or CAPTURE_LIMIT captures in a row whose graph replayed only once (the capture's
# own call), GraphedStep says once why, and stops capturing (every step eager) until the optimizer's settings
# or state change: a capture costs several eager steps.
MISS_LIMIT = 8
CAPTURE_LIMIT = 3


def _addresses(tensors: list) -> list[int]:
    """Storage addresses (0 for None; a DTensor's local shard), with one C-level pass in the common case."""
    if any(map(operator.is_, tensors, itertools.repeat(None))) or any(map(D.is_dtensor, tensors)):
        return [0 if t is None else D.local(t).data_ptr() for t in tensors]
    return list(map(_data_ptr, tensors))


def _setting(value):
    return id(value) if isinstance(value, torch.Tensor) else value


class GraphedStep:
    """Call it in place of ``optimizer.step()``: the first call steps eagerly (the warm-up a capture needs), a
    call that finds the same tensors as the one before captures the step in a CUDA graph and replays it, and
    later calls replay it for as long as nothing it reads moved.

    Args:
        optimizer: a flashdist optimizer built with ``capturable=True``, whose parameters are on one
            CUDA device and whose backend is the Triton kernel ("auto" or "triton").

    A float learning rate (what LR schedulers set), or one in a CPU tensor, is copied at each call into a
    device tensor the graph reads (checked as ``step()`` checks it), so schedules need no recapture; a learning
    rate in a tensor on the parameters' device is read where it is. Gradients at new addresses (new tensors
    after ``zero_grad(set_to_none=True)``; FSDP2's DTensors by their local shards) are followed: the captured
    tables are pointed at them before the replay (checked as an eager step checks them; one of another dtype,
    or one that breaks the 16-byte alignment the capture relied on, makes the call eager). Any other
    hyper-parameter changed, a parameter given or denied a gradient, a parameter at a new address, a param
    group added, or state replaced (``load_state_dict``) makes that call an eager step. A step the graph
    cannot capture (parameters at different step counts: ``flashdist.errors.CaptureRefused``) runs eagerly
    until something changes. Where steps keep missing the graph (``MISS_LIMIT`` eager calls in a row, or
    ``CAPTURE_LIMIT`` captures in a row replayed once: parameters that move at every step), one warning says
    why and it stops capturing until the optimizer's settings or state change. Not seen: data swapped into a
    state tensor in place (``set_``, ``.data =``); the optimizer itself does not. Replays and the table
    updates before them run on the current stream: step on the same stream at each call.

    Step hooks run when ``optimizer.step()`` runs: at eager steps and at the capture, not at replays (a
    ``graphed=True`` optimizer runs its own GraphedStep inside ``step()``, so its hooks run at every step).
    ``captures``, ``replays`` and ``eager_steps`` count what the calls did. ``eager``: the step an eager call
    and the capture run (default ``optimizer.step``). ``strict=False``: a call that finds the optimizer no
    longer fit for a graph (the checks of the constructor: a group emptied, parameters moved off the GPU)
    steps eagerly instead of raising, until the settings change again.
    """

    def __init__(self, optimizer, *, eager=None, strict: bool = True):
        if not hasattr(optimizer, "plan_generation"):  # (a FlashOptimizer: base.py imports this module)
            raise TypeError(f"flashdist: GraphedStep takes a flashdist optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._eager = eager or optimizer.step  # what an eager step and the capture run
        self._strict = strict  # False: a later call that fails the constructor's checks steps eagerly instead
        self._unusable = False  # (not strict) the last checks failed: eager steps until the settings change
        self.device = self._check()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = self.replays = self.eager_steps = 0
        self._host = host.load()  # the compiled address check (None: the same in Python)
        self._settings = None  # what _settings_key gave at the last call
        # per group: [its params list, param addresses, which grads are None, scratch] at the last call
        self._seen: list[list] = []
        self._plans: list = []  # the launch plans the graph holds (kernels.triton.plans.collect_captured)
        self._unique_plans: list = []  # the same, each once
        self._plan_params: list[list] = []  # per plan: the optimizer's parameters of its lists, in their order
        # per launch that reads gradient addresses from device cells (FlashMuon's Muon matrices): its parameters,
        # the cells, the gradient dtypes it was captured with, and the addresses last written into the cells
        self._cells: list[tuple[list, torch.Tensor, list, list]] = []
        self._info: list[tuple] = []  # per plan: what _map_plans prepared for the compiled check
        self._why: str | None = None  # why the last call stepped eagerly
        self._misses = 0  # eager calls in a row since the last replay (after the warm-up)
        self._short = 0  # captures in a row whose graph was replayed only by the capture's own call
        self._replays_at_capture = 0  # self.replays when the graph in hand was captured
        self._gave_up = False  # MISS_LIMIT or CAPTURE_LIMIT was reached: eager until the settings change
        self._warned = False
        self._refused = False  # the last capture was refused: none is tried until something changes
        # one fp64 device tensor per group, read by the graph in place of a float learning rate
        self._lr: list[torch.Tensor] = []
        self._lr_written: list[float | None] = []

    def _check(self) -> torch.device:
        """The parameters' device, after the checks of the constructor (run again when the groups change)."""
        optimizer = self.optimizer
        if optimizer.backend not in ("auto", "triton"):
            raise ValueError(f"flashdist: GraphedStep needs the Triton kernel; the optimizer's backend is "
                             f"{optimizer.backend!r} (use backend='auto' or 'triton')")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("flashdist: GraphedStep got an optimizer without parameters")
        if not optimizer.capturable:
            raise ValueError("flashdist: GraphedStep needs an optimizer built with capturable=True")
        devices = {D.local(p).device for p in params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError("flashdist: GraphedStep needs the parameters on one CUDA device, got "
                             f"{sorted(map(str, devices))}")
        return next(iter(devices))

    def _device_lr(self, lr) -> bool:
        return isinstance(lr, torch.Tensor) and lr.device == self.device

    def _settings_key(self) -> tuple:
        """The optimizer's step plans (they change with its state tensors), backend and capturable, and each group's
        settings other than a learning rate the graph does not hold."""
        return (self.optimizer.plan_generation, self.optimizer.backend, self.optimizer.capturable, *(
            (len(group["params"]), id(group["lr"]) if self._device_lr(group["lr"]) else float,
             tuple((k, _setting(v)) for k, v in group.items() if k not in ("params", "lr", "param_names")))
            for group in self.optimizer.param_groups))

    def _unchanged(self) -> bool:
        """Whether everything a replay reads, other than the gradients' addresses, is where the last call found
        it (the same settings, parameter addresses, parameters with a gradient); records what this call finds,
        and why not in ``_why``."""
        settings = self._settings_key()
        same = settings == self._settings
        if not same:
            self._why = "the optimizer's hyper-parameters, param groups or state changed"
            self._gave_up = False
            try:
                device = self._check()  # (a group added, a setting changed: the same checks as the constructor's)
            except ValueError as e:
                if self._strict:
                    raise
                self._unusable = True
                self._why = str(e).removeprefix("flashdist: ")
            else:
                self._unusable = False
                if device != self.device:  # (parameters moved to another GPU)
                    self.device, self._seen = device, []
        self._settings = settings
        if self._unusable:
            return False
        groups = self.optimizer.param_groups
        if len(self._seen) != len(groups):
            self._seen = [[None, None, None, None] for _ in groups]
            self._lr = [torch.zeros((), dtype=torch.float64, device=self.device) for _ in groups]
            self._lr_written = [None] * len(groups)
        dtensors = bool(self.optimizer._dtensor_groups)
        for group, seen in zip(groups, self._seen):
            params = group["params"]
            if seen[0] is not params or len(seen[1]) != len(params):
                seen[:] = [params, torch.zeros(len(params), dtype=torch.int64), None,
                           torch.zeros(len(params), dtype=torch.int64)]
                same = False
            if self._params_moved(params, seen[1], dtensors):
                same = False
                self._why = "a parameter is at a new address"
            missing = self._missing_grads(params, seen[3], dtensors)
            if seen[2] is None or not torch.equal(missing, seen[2]):
                if seen[2] is not None:
                    self._why = "a parameter was given or denied a gradient"
                seen[2] = missing
                same = False
        return same

    def _missing_grads(self, params: list, scratch: torch.Tensor, dtensors: bool) -> torch.Tensor:
        """A bool tensor, True for each parameter without a gradient: read in C++ where it is built (the
        gradients' addresses, 0 for none, into ``scratch``), which makes no Python object per gradient (a
        backward pass's new gradients have none until Python reads them: a microsecond or two each)."""
        if self._host is not None and not dtensors:
            try:
                self._host.addresses_changed(params, True, scratch)
                return scratch == 0
            except RuntimeError:  # a DTensor: in Python
                pass
        return torch.tensor(list(map(operator.is_, list(map(_GRAD, params)), _NONE)), dtype=torch.bool)

    def _params_moved(self, params: list, seen: torch.Tensor, dtensors: bool = False) -> bool:
        """Whether a parameter's address (a DTensor's: its local shard's) differs from ``seen``, which records
        the new ones."""
        if self._host is not None and not dtensors:
            try:
                return self._host.addresses_changed(params, False, seen)
            except RuntimeError:  # a tensor without data of its own (a DTensor): in Python, its local tensor
                pass
        new = torch.tensor(_addresses(params), dtype=torch.int64)
        if torch.equal(new, seen):
            return False
        seen.copy_(new)
        return True

    def _addresses_changed(self, params: list, param_seen: torch.Tensor, grad_seen: torch.Tensor,
                           dtensors: bool = False) -> bool:
        """Whether the address of a parameter or of its gradient differs from those seen (recorded)."""
        return self._params_moved(params, param_seen, dtensors) | self._grads_moved(params, grad_seen, dtensors)

    def _grads_moved(self, params: list, seen: torch.Tensor, dtensors: bool = False) -> bool:
        """Whether the address of a parameter's gradient (0 for none; a DTensor's: its local shard's) differs from
        ``seen``, which records the new ones: the check of the gradients a captured step reads where they were
        (FlashMuon's Muon matrices)."""
        if self._host is not None and not dtensors:
            try:
                return self._host.addresses_changed(params, True, seen)
            except RuntimeError:  # a DTensor: in Python
                pass
        new = torch.tensor(_addresses(list(map(_GRAD, params))), dtype=torch.int64)
        if torch.equal(new, seen):
            return False
        seen.copy_(new)
        return True

    def _map_plans(self) -> None:
        """The optimizer's parameters of each captured plan's lists, in their order (found by the local
        tensors' addresses, which the plan records), so that each replay finds the plan's gradients; and,
        for the compiled check, the dtypes and numels of the gradients the capture took."""
        by_address = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                by_address.setdefault(D.local(p).data_ptr(), p)
        self._unique_plans = list(dict.fromkeys(self._plans))
        for plan in self._unique_plans:  # (what the tables hold: the capture ran nothing, retarget writes it)
            plan.grad_addresses = torch.tensor(plan.grad_ptrs, dtype=torch.int64)
        self._plan_params = [[by_address.get(a) for a in plan.param_ptrs] for plan in self._unique_plans]
        self._info = []  # per plan: int64 (3, tensors) addresses, dtypes, numels (kernels.host.grad_info), and
        #                  the dtypes and numels the capture took (None: check in Python)
        for params in self._plan_params:
            info = torch.zeros((3, len(params)), dtype=torch.int64)
            fitted = None
            if (self._host is not None and not self.optimizer._dtensor_groups
                    and not any(map(operator.is_, params, _NONE)) and self._host.grad_info(params, *info)):
                fitted = info[1:].clone()
            self._info.append((info, fitted))

    def _retarget(self) -> bool:
        """Point each captured plan's tables at this call's gradients (outside the graph, before the replay);
        False where one does not fit (``Plan.fits``: another dtype or alignment) or cannot be found. Checked in
        C++ (``kernels.host.grad_info``: a few nanoseconds per gradient), in Python where that is not built,
        for DTensors, or to say which gradient is off."""
        for params, cells, dtypes, written in self._cells:
            grads = list(map(_GRAD, params))
            if any(map(operator.is_, grads, _NONE)):
                self._why = "a parameter was given or denied a gradient"
                return False
            if any(g.dtype is not d or not g.is_contiguous() or g.device != cells.device
                   for g, d in zip(grads, dtypes)):
                self._why = "a Muon matrix's gradient has another dtype or device, or is not contiguous"
                return False
            addresses = list(map(_data_ptr, grads))
            if addresses != written:  # (one small host-to-device copy, ordered before the replay on this stream)
                if any(a % 16 for a in addresses):  # (the captured kernels load gradients 16 bytes at a time)
                    self._why = "a Muon matrix's gradient breaks the 16-byte alignment the capture used"
                    return False
                cells.copy_(torch.tensor([[a, 0] for a in addresses], dtype=torch.int64))
                written[:] = addresses
        for plan, params, (info, fitted) in zip(self._unique_plans, self._plan_params, self._info):
            if fitted is not None and self._host.grad_info(params, *info) and torch.equal(info[1:], fitted):
                if not torch.equal(info[0], plan.grad_addresses) and not plan.retarget_addresses(info[0]):
                    self._why = "a gradient breaks the 16-byte alignment the capture used"
                    return False
                continue
            if any(map(operator.is_, params, _NONE)):
                self._why = "a parameter of the captured step is no longer in the optimizer's param groups"
                return False
            grads = list(map(_GRAD, params))
            if any(map(operator.is_, grads, _NONE)):
                self._why = "a parameter was given or denied a gradient"
                return False
            if self.optimizer._dtensor_groups:
                grads = list(map(D.local, grads))
            ptrs = list(map(_data_ptr, grads))
            if ptrs != plan.grad_ptrs and not plan.retarget(grads, ptrs):
                self._why = "a gradient has another dtype, or breaks the 16-byte alignment the capture used"
                return False
        return True

    def _write_lrs(self) -> None:
        """Copy each group's learning rate that the graph does not read in place (a float, a CPU tensor) to the
        device tensor it reads instead, where it changed; checked first, as ``step()`` checks it."""
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]
            if self._device_lr(lr):
                continue
            value = float(lr)
            if value != self._lr_written[i]:
                check_number("lr", value, low=0.0)
                self._lr[i].fill_(value)
                self._lr_written[i] = value

    def _capture(self) -> None:
        groups = self.optimizer.param_groups
        held = [(group, group["lr"]) for group in groups if not self._device_lr(group["lr"])]
        graph = torch.cuda.CUDAGraph()
        try:
            for i, group in enumerate(groups):  # the graph reads the device copy of the learning rate
                if not self._device_lr(group["lr"]):
                    group["lr"] = self._lr[i]
            with plans.collect_captured() as kept:
                self.optimizer._grad_cells = []
                try:
                    with torch.cuda.graph(graph):
                        self._eager()
                finally:
                    self._plans = kept
                    cells, self.optimizer._grad_cells = self.optimizer._grad_cells, None
                    self._cells = [(params, cell, dtypes, []) for params, cell, dtypes in cells]
                    self._map_plans()
        finally:
            for group, lr in held:
                group["lr"] = lr
        self.graph = graph
        self.captures += 1
        self._replays_at_capture = self.replays

    def _drop(self) -> None:
        """Drop the graph (its memory pool is freed) and release the launch plans it held."""
        if self.graph is not None:
            # a graph replayed only by the call that captured it cost a capture for one step
            self._short = self._short + 1 if self.replays - self._replays_at_capture <= 1 else 0
        self.graph = None
        plans.release_captured(self._plans)
        self._plans, self._plan_params, self._unique_plans, self._info = [], [], [], []
        self._cells = []

    @torch.no_grad()
    def __call__(self) -> None:
        unchanged = self._unchanged()
        if unchanged and self.graph is None and not self._refused and not self._gave_up:
            # the last call stepped eagerly with these very parameters and settings (a warm-up): capture (it
            # runs nothing), then point the graph at this call's gradients and replay below
            self._write_lrs()
            self.optimizer._adopt_outside_writes_of_plans()  # (a reset inside the capture would refuse it)
            try:
                self._capture()
            except CaptureRefused as e:  # nothing changed: step eagerly, and try again once something has
                self._drop()           # (or at the next call, where this call's gradients were the reason)
                self._refused = not e.retry
                self._why = f"the step cannot be captured ({str(e).removeprefix('flashdist: ')})"
        if unchanged and self.graph is not None:
            if self._retarget():
                self._write_lrs()
                # weights written outside the optimizer since the last call (load_state_dict, SWA's
                # copy-back): their rho reset, as an eager step would reset it, before the graph reads it
                self.optimizer._adopt_outside_writes_of_plans()
                self.graph.replay()
                self.replays += 1
                self._misses = 0
                return
            unchanged = False
        if not unchanged:
            self._drop()
            self._refused = False
        self._eager()
        if self.eager_steps:  # (the first call is the warm-up)
            self._misses += 1
        self.eager_steps += 1
        self._settings = self._settings_key()  # (the step may have made new plans)
        if not self._gave_up and (self._misses >= MISS_LIMIT or self._short >= CAPTURE_LIMIT):
            self._give_up()

    def _give_up(self) -> None:
        """Stop capturing until the optimizer's settings or state change, and say why once."""
        if not self._warned:
            self._warned = True
            counts = (f"{self._misses} calls in a row stepped eagerly" if self._misses >= MISS_LIMIT else
                      f"{self._short} captures in a row were replayed only once")
            warnings.warn(f"flashdist: the graphed step is not replaying ({counts}; the last because "
                          f"{self._why or 'something the graph reads changed'}): steps run eagerly from now on, "
                          "until the optimizer's settings or state change. A replay needs the parameters at the "
                          "addresses of the capture; GraphedStep.eager_steps and .replays count what happened.",
                          UserWarning, stacklevel=3)
        self._gave_up = True
        self._misses = self._short = 0
